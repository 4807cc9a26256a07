import { execFile } from "node:child_process";
import { randomBytes } from "node:crypto";
import { mkdtemp, readFile, rm, writeFile } from "node:fs/promises";
import { isIP } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { abortReason, HubError, InvalidArgumentError, throwIfAborted } from "@moeswarm/core";

export interface LoopbackCertificateOptions {
  /**
   * DNS names and IP addresses the certificate is valid for (default localhost, 127.0.0.1 and
   * ::1). Clients must dial the hub by one of them.
   */
  hosts?: readonly string[];
  /** Days the CA and the certificate stay valid (default 365, at most 3650). */
  days?: number;
  signal?: AbortSignal;
}

/** PEM texts: the CA clients trust, and the certificate and key the hub serves. */
export interface LoopbackCertificates {
  /** The CA certificate: what workers and backbones pass as `ca` (the CLIs' `--ca`). */
  ca: string;
  /** The server certificate for `hosts`, signed by the CA. */
  cert: string;
  /** The server certificate's private key (unencrypted). */
  key: string;
}

const DEFAULT_HOSTS: readonly string[] = ["localhost", "127.0.0.1", "::1"];
const MAX_HOSTS = 64;
const MAX_DAYS = 3650;
// RFC 1123 labels, an optional leading wildcard label; nothing that could end an openssl value
const DNS_NAME =
  /^(\*\.)?([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)*[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$/;
// openssl asks nothing with these options; the bound is for a broken install that would
const OPENSSL_TIMEOUT_MS = 60_000;

/**
 * A throwaway certificate authority and a server certificate it signs, for a hub on loopback or a
 * self-hosted network: `createHub({ tls: { cert, key } })` serves https and wss with it, and
 * clients trust `ca` (workers and backbones take it as `--ca`). Made with the openssl CLI (it must
 * be on PATH), with P-256 keys. The CA's private key is deleted once it has signed the
 * certificate, so the CA can vouch for nothing else. Not for a hub on the public internet: use a
 * certificate from a public CA there (`--tls-cert`, `--tls-key`).
 *
 * Throws InvalidArgumentError for a bad host or day count, HubError MOESWARM_HUB_TLS when openssl
 * is missing or fails.
 */
export async function createLoopbackCertificates(
  options: LoopbackCertificateOptions = {},
): Promise<LoopbackCertificates> {
  const { signal } = options;
  const hosts = checkHosts(options.hosts ?? DEFAULT_HOSTS);
  const days = options.days ?? 365;
  if (!Number.isInteger(days) || days < 1 || days > MAX_DAYS) {
    throw new InvalidArgumentError(`days must be an integer in 1..${MAX_DAYS}, got ${String(days)}`);
  }
  throwIfAborted(signal);
  const dir = await mkdtemp(join(tmpdir(), "moeswarm-tls-"));
  try {
    const id = randomBytes(4).toString("hex");
    const altNames = hosts.map((h) => (isIP(h) ? `IP:${h}` : `DNS:${h}`)).join(", ");
    // a configuration of our own, so that the system's openssl.cnf changes nothing
    await writeFile(
      join(dir, "openssl.cnf"),
      [
        "[req]",
        "distinguished_name = dn",
        "prompt = no",
        "[dn]",
        "[ca_ext]",
        "basicConstraints = critical, CA:TRUE, pathlen:0",
        "keyUsage = critical, keyCertSign, cRLSign",
        "subjectKeyIdentifier = hash",
        "[leaf_ext]",
        "basicConstraints = critical, CA:FALSE",
        "keyUsage = critical, digitalSignature",
        "extendedKeyUsage = serverAuth",
        `subjectAltName = ${altNames}`,
        "subjectKeyIdentifier = hash",
        "authorityKeyIdentifier = keyid",
        "",
      ].join("\n"),
    );
    const ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-config", "openssl.cnf"];
    const run = (args: string[]) => openssl(args, dir, signal);
    await run([
      "req",
      "-x509",
      ...ec,
      "-extensions",
      "ca_ext",
      "-keyout",
      "ca.key",
      "-out",
      "ca.crt",
      "-days",
      String(days),
      "-subj",
      `/CN=moeswarm local CA ${id}`,
    ]);
    const cn = hosts[0]!.length <= 64 ? hosts[0]! : "moeswarm hub";
    await run(["req", "-new", ...ec, "-keyout", "leaf.key", "-out", "leaf.csr", "-subj", `/CN=${cn}`]);
    // a random serial rather than a serial file next to the CA, which is not kept
    const serial = randomBytes(16);
    serial[0]! &= 0x7f; // positive, as RFC 5280 wants
    await run([
      "x509",
      "-req",
      "-in",
      "leaf.csr",
      "-CA",
      "ca.crt",
      "-CAkey",
      "ca.key",
      "-set_serial",
      `0x${serial.toString("hex")}`,
      "-days",
      String(days),
      "-extfile",
      "openssl.cnf",
      "-extensions",
      "leaf_ext",
      "-out",
      "leaf.crt",
    ]);
    const read = (f: string) => readFile(join(dir, f), "utf8");
    return { ca: await read("ca.crt"), cert: await read("leaf.crt"), key: await read("leaf.key") };
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
}

/** Whether `host` can name a certificate's subject: an IP address or a DNS name. */
export function isCertificateHost(host: string): boolean {
  // an IPv6 zone (fe80::1%eth0) means nothing in a certificate
  return (isIP(host) !== 0 && !host.includes("%")) || (host.length <= 253 && DNS_NAME.test(host));
}

function checkHosts(hosts: readonly string[]): string[] {
  if (!Array.isArray(hosts) || hosts.length === 0 || hosts.length > MAX_HOSTS) {
    throw new InvalidArgumentError(`hosts must be a list of 1..${MAX_HOSTS} DNS names or IP addresses`);
  }
  const out: string[] = [];
  for (const host of hosts) {
    if (typeof host !== "string" || !isCertificateHost(host)) {
      throw new InvalidArgumentError(`${JSON.stringify(host)} is neither a DNS name nor an IP address`);
    }
    if (!out.includes(host)) out.push(host);
  }
  return out;
}

function openssl(args: string[], cwd: string, signal: AbortSignal | undefined): Promise<void> {
  return new Promise((resolve, reject) => {
    execFile("openssl", args, { cwd, signal, timeout: OPENSSL_TIMEOUT_MS }, (error, _stdout, stderr) => {
      if (!error) return resolve();
      if (signal?.aborted) return reject(abortReason(signal));
      const code = (error as NodeJS.ErrnoException).code;
      reject(
        new HubError(
          "MOESWARM_HUB_TLS",
          code === "ENOENT"
            ? "the openssl CLI is not on PATH; install it (apt-get install openssl, dnf install openssl, brew install openssl) or give a certificate and key of your own"
            : `openssl ${args[0]} failed: ${String(stderr).trim() || error.message}`,
          { cause: error },
        ),
      );
    });
  });
}
