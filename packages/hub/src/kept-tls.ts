// A self-signed hub's certificates kept in its data directory, so that a restart serves the same
// CA and the workers and backbones that trust it (`--ca`) reconnect as before.
import { createPrivateKey, X509Certificate } from "node:crypto";
import { mkdir, readFile, rename, writeFile } from "node:fs/promises";
import { isIP } from "node:net";
import { join } from "node:path";
import { errorFromSystemError } from "@moeswarm/core";
import {
  createLoopbackCertificates,
  type LoopbackCertificateOptions,
  type LoopbackCertificates,
} from "./loopback-tls.js";

/** The files in the directory: the CA clients trust, and the certificate and key the hub serves. */
const FILES = { ca: "ca.crt", cert: "cert.pem", key: "key.pem" } as const;

/** A certificate this close to its end is made anew rather than served (ms). */
const RENEW_BEFORE_MS = 86_400_000;

export interface KeptCertificates extends LoopbackCertificates {
  /** Why they were made now: undefined when the kept ones were reused. */
  made: "missing" | "expired" | "hosts" | "unreadable" | undefined;
}

/**
 * The certificates kept in `dir` when they are all there, parse, chain (the certificate signed by
 * the CA), are valid for another day and name exactly `hosts`; otherwise new ones (see
 * createLoopbackCertificates) written there (the key readable by its owner only) and returned.
 * Throws MoeswarmError MOESWARM_IO_* when the directory cannot be written, HubError
 * MOESWARM_HUB_TLS when openssl fails.
 */
export async function keptLoopbackCertificates(
  dir: string,
  options: LoopbackCertificateOptions & { hosts: readonly string[]; now?: number },
): Promise<KeptCertificates> {
  const kept = await readKept(dir);
  const why = kept ? staleness(kept, options.hosts, options.now ?? Date.now()) : "missing";
  if (kept && why === undefined) return { ...kept, made: undefined };
  const certs = await createLoopbackCertificates(options);
  try {
    await mkdir(dir, { recursive: true, mode: 0o700 });
    // the CA last: a CA file alone never stands for a pair that was not written
    for (const [name, file] of [
      ["key", FILES.key],
      ["cert", FILES.cert],
      ["ca", FILES.ca],
    ] as const) {
      const path = join(dir, file);
      await writeFile(`${path}.tmp`, certs[name], { mode: name === "key" ? 0o600 : 0o644 });
      await rename(`${path}.tmp`, path);
    }
  } catch (error) {
    throw errorFromSystemError(error, `writing the hub's TLS certificates to ${dir}`);
  }
  return { ...certs, made: why };
}

async function readKept(dir: string): Promise<LoopbackCertificates | undefined> {
  try {
    const [ca, cert, key] = await Promise.all(
      [FILES.ca, FILES.cert, FILES.key].map((f) => readFile(join(dir, f), "utf8")),
    );
    return { ca: ca as string, cert: cert as string, key: key as string };
  } catch (error) {
    if ((error as NodeJS.ErrnoException).code === "ENOENT") return undefined;
    throw errorFromSystemError(error, `reading the hub's TLS certificates in ${dir}`);
  }
}

/** Why kept certificates cannot be served again, or undefined when they can. */
function staleness(
  kept: LoopbackCertificates,
  hosts: readonly string[],
  now: number,
): KeptCertificates["made"] {
  let ca: X509Certificate;
  let cert: X509Certificate;
  try {
    ca = new X509Certificate(kept.ca);
    cert = new X509Certificate(kept.cert);
    if (!cert.checkIssued(ca) || !cert.verify(ca.publicKey)) return "unreadable";
    if (!cert.checkPrivateKey(createPrivateKey(kept.key))) return "unreadable";
  } catch {
    return "unreadable";
  }
  for (const c of [ca, cert]) {
    if (Date.parse(c.validTo) - RENEW_BEFORE_MS <= now || Date.parse(c.validFrom) > now) return "expired";
  }
  const named = new Set(
    (cert.subjectAltName ?? "")
      .split(/,\s*/)
      .filter((s) => s.length > 0)
      .map((s) => s.replace(/^(DNS|IP Address):/, "")),
  );
  const wanted = new Set(hosts.map((h) => (isIP(h) === 6 ? expandV6(h) : h)));
  const have = new Set([...named].map((h) => (isIP(h) === 6 ? expandV6(h) : h)));
  if (wanted.size !== have.size || [...wanted].some((h) => !have.has(h))) return "hosts";
  return undefined;
}

/** An IPv6 address in one spelling (node prints a certificate's as the full form). */
function expandV6(address: string): string {
  const [head = "", tail = ""] = address.toLowerCase().split("::");
  const h = head ? head.split(":") : [];
  const t = tail ? tail.split(":") : [];
  const fill = address.includes("::") ? Array(8 - h.length - t.length).fill("0") : [];
  return [...h, ...fill, ...t].map((p) => p.replace(/^0+(?=.)/, "")).join(":");
}
