import { X509Certificate } from "node:crypto";
import { readFileSync, statSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { afterAll, describe, expect, it } from "vitest";
import { keptLoopbackCertificates } from "../src/kept-tls.js";
import { type TempDir, tempDir } from "./hub-helpers.js";

const tmp: TempDir = tempDir("moeswarm-kept-tls-");
afterAll(() => tmp.remove());

describe("keptLoopbackCertificates", () => {
  it("makes them when missing, reuses them, and makes them anew when expired, other hosts or damaged", async () => {
    const dir = join(tmp.dir, "tls");
    const hosts = ["localhost", "127.0.0.1", "::1"];
    const first = await keptLoopbackCertificates(dir, { hosts });
    expect(first.made).toBe("missing");
    expect(statSync(join(dir, "key.pem")).mode & 0o777).toBe(0o600);
    const again = await keptLoopbackCertificates(dir, { hosts: ["127.0.0.1", "localhost", "::1"] });
    expect(again.made).toBeUndefined();
    expect(again.ca).toBe(first.ca);
    expect(again.key).toBe(first.key);
    // a day before the end is too late to serve them
    const end = Date.parse(new X509Certificate(first.cert).validTo);
    const expired = await keptLoopbackCertificates(dir, { hosts, now: end - 3_600_000 });
    expect(expired.made).toBe("expired");
    expect(expired.ca).not.toBe(first.ca);
    const other = await keptLoopbackCertificates(dir, { hosts: [...hosts, "hub.example"] });
    expect(other.made).toBe("hosts");
    writeFileSync(join(dir, "cert.pem"), readFileSync(join(dir, "ca.crt")));
    expect((await keptLoopbackCertificates(dir, { hosts: [...hosts, "hub.example"] })).made).toBe(
      "unreadable",
    );
  });

  it("says MOESWARM_IO_NOT_FOUND when the directory cannot be made (a file stands there)", async () => {
    const file = join(tmp.dir, "a-file");
    writeFileSync(file, "x");
    await expect(keptLoopbackCertificates(join(file, "tls"), { hosts: ["localhost"] })).rejects.toMatchObject(
      {
        code: "MOESWARM_IO_NOT_FOUND",
      },
    );
  });
});
