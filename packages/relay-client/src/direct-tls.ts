import { execFile } from "node:child_process";
import { mkdtemp, readFile, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { InvalidArgumentError, throwIfAborted } from "@moeswarm/core";

/*
 * A self-signed certificate for a worker's direct endpoint. Backbones pin its SHA-256
 * fingerprint (published by the hub), so no CA and no host name is involved: any self-signed
 * certificate will do. It is made with the openssl CLI, as the hub's loopback certificates are:
 * node:crypto makes keys but not certificates, and the libraries that do (pkijs and its kin)
 * need a newer Node 20 than this project supports.
 */

const OPENSSL_TIMEOUT_MS = 60_000;

/** A throwaway self-signed P-256 certificate (PEM) valid for `days` (default 30). */
export async function selfSignedCertificate(
  options: { days?: number; signal?: AbortSignal } = {},
): Promise<{ cert: string; key: string }> {
  throwIfAborted(options.signal);
  const days = options.days ?? 30;
  if (!Number.isInteger(days) || days < 1 || days > 3650) {
    throw new InvalidArgumentError("days must be an integer in 1..3650");
  }
  const dir = await mkdtemp(join(tmpdir(), "moeswarm-direct-"));
  try {
    const keyPath = join(dir, "key.pem");
    const certPath = join(dir, "cert.pem");
    await new Promise<void>((resolve, reject) => {
      execFile(
        "openssl",
        [
          "req",
          "-x509",
          "-newkey",
          "ec",
          "-pkeyopt",
          "ec_paramgen_curve:prime256v1",
          "-nodes",
          "-keyout",
          keyPath,
          "-out",
          certPath,
          "-days",
          String(days),
          "-subj",
          "/CN=moeswarm-worker",
        ],
        { timeout: OPENSSL_TIMEOUT_MS, ...(options.signal ? { signal: options.signal } : {}) },
        (error, _stdout, stderr) => {
          if (!error) resolve();
          else
            reject(
              new InvalidArgumentError(
                `could not make a certificate for the direct endpoint with openssl (${error.message.split("\n")[0]}${stderr ? `: ${stderr.trim().split("\n")[0]}` : ""}); ` +
                  "install openssl, or pass a certificate and key (--tls-cert, --tls-key)",
                { cause: error },
              ),
            );
        },
      );
    });
    return { cert: await readFile(certPath, "utf8"), key: await readFile(keyPath, "utf8") };
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
}
