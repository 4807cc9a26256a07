import { createPrivateKey, X509Certificate } from "node:crypto";
import { mkdtempSync, rmSync } from "node:fs";
import { createServer, get, type Server } from "node:https";
import type { AddressInfo } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { HubError, InvalidArgumentError } from "@moeswarm/core";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { createLoopbackCertificates, type LoopbackCertificates } from "../src/index.js";

let certs: LoopbackCertificates;
let server: Server;
let port: number;

beforeAll(async () => {
  certs = await createLoopbackCertificates({ hosts: ["localhost", "127.0.0.1", "hub.test"], days: 3 });
  server = createServer({ cert: certs.cert, key: certs.key }, (_req, res) => res.end("hello over tls"));
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  port = (server.address() as AddressInfo).port;
});
afterAll(() => new Promise<void>((resolve) => server.close(() => resolve())));

/** GET / on the test server as `servername` (the name the client checks the certificate for). */
function fetchAs(servername: string, ca?: string): Promise<string> {
  return new Promise((resolve, reject) => {
    get({ host: "127.0.0.1", port, path: "/", servername, ca, agent: false }, (res) => {
      let body = "";
      res.on("data", (c: Buffer) => {
        body += c.toString();
      });
      res.on("end", () => resolve(body));
    }).on("error", reject);
  });
}

describe("createLoopbackCertificates", () => {
  it("makes a CA and a server certificate it signs, for exactly the given names", () => {
    const ca = new X509Certificate(certs.ca);
    const leaf = new X509Certificate(certs.cert);
    expect(ca.ca).toBe(true);
    expect(leaf.ca).toBe(false);
    expect(leaf.checkIssued(ca)).toBe(true);
    expect(leaf.verify(ca.publicKey)).toBe(true);
    expect(leaf.checkPrivateKey(createPrivateKey(certs.key))).toBe(true);
    expect(leaf.subjectAltName).toBe("DNS:localhost, IP Address:127.0.0.1, DNS:hub.test");
    expect(leaf.keyUsage).toEqual(["1.3.6.1.5.5.7.3.1"]); // serverAuth
    const days = (Date.parse(leaf.validTo) - Date.parse(leaf.validFrom)) / 86_400_000;
    expect(days).toBe(3);
    // each CA has a name of its own, so that a client trusting two never confuses them
    expect(ca.subject).toMatch(/^CN=moeswarm local CA [0-9a-f]{8}$/);
  });

  it("is trusted by a TLS client given the CA, for its names only, and not without the CA", async () => {
    expect(await fetchAs("localhost", certs.ca)).toBe("hello over tls");
    expect(await fetchAs("hub.test", certs.ca)).toBe("hello over tls");
    await expect(fetchAs("other.test", certs.ca)).rejects.toMatchObject({
      code: "ERR_TLS_CERT_ALTNAME_INVALID",
    });
    await expect(fetchAs("localhost")).rejects.toMatchObject({
      code: expect.stringMatching(/UNABLE_TO_VERIFY_LEAF_SIGNATURE|SELF_SIGNED|UNABLE_TO_GET_ISSUER/),
    });
  });

  it("refuses names that are not DNS names or IP addresses, and bad day counts, before running openssl", async () => {
    for (const hosts of [
      [],
      ["a b"],
      ["localhost, DNS:evil.test"],
      ["x\nsubjectAltName=DNS:evil"],
      ["-a.test"],
      ["fe80::1%eth0"],
    ]) {
      await expect(createLoopbackCertificates({ hosts })).rejects.toBeInstanceOf(InvalidArgumentError);
    }
    for (const days of [0, 1.5, 3651, Number.NaN]) {
      await expect(createLoopbackCertificates({ days })).rejects.toBeInstanceOf(InvalidArgumentError);
    }
  });

  it("says so with HubError MOESWARM_HUB_TLS when the openssl CLI is missing", async () => {
    const empty = mkdtempSync(join(tmpdir(), "moeswarm-no-openssl-"));
    const path = process.env.PATH;
    process.env.PATH = empty;
    try {
      const error = await createLoopbackCertificates().catch((e: unknown) => e);
      expect(error).toBeInstanceOf(HubError);
      expect(error).toMatchObject({ code: "MOESWARM_HUB_TLS", message: expect.stringMatching(/openssl/) });
    } finally {
      process.env.PATH = path;
      rmSync(empty, { recursive: true, force: true });
    }
  });

  it("rejects with the signal's reason when aborted before or while it runs", async () => {
    const reason = new Error("stop");
    await expect(createLoopbackCertificates({ signal: AbortSignal.abort(reason) })).rejects.toBe(reason);
    const c = new AbortController();
    const pending = createLoopbackCertificates({ signal: c.signal });
    c.abort(reason);
    await expect(pending).rejects.toBe(reason);
  });
});
