import { execFileSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

export interface LoopbackCerts {
  /** The throwaway CA the workers and the backbone trust. */
  ca: string;
  /** Leaf for localhost and 127.0.0.1, signed by the CA. */
  cert: string;
  key: string;
}

/**
 * A throwaway CA and a loopback leaf, made with the openssl CLI: the demo runs real TLS (wss on
 * the relay, https downloads) exactly as a self-hosted hub on port 443 would, with nothing to
 * configure. The keys live only in this process's memory once read.
 */
export function makeLoopbackCerts(): LoopbackCerts {
  const dir = mkdtempSync(join(tmpdir(), "moeswarm-demo-tls-"));
  const run = (args: string[]) => execFileSync("openssl", args, { cwd: dir, stdio: "pipe" });
  try {
    const ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"];
    run([
      "req",
      "-x509",
      ...ec,
      "-keyout",
      "ca.key",
      "-out",
      "ca.crt",
      "-days",
      "1",
      "-subj",
      "/CN=moeswarm demo CA",
    ]);
    run(["req", ...ec, "-keyout", "leaf.key", "-out", "leaf.csr", "-subj", "/CN=localhost"]);
    writeFileSync(
      join(dir, "leaf.ext"),
      "basicConstraints=CA:FALSE\nsubjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    );
    run(
      ["x509", "-req", "-in", "leaf.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial"].concat([
        "-out",
        "leaf.crt",
        "-days",
        "1",
        "-extfile",
        "leaf.ext",
      ]),
    );
    const read = (f: string) => readFileSync(join(dir, f), "utf8");
    return { ca: read("ca.crt"), cert: read("leaf.crt"), key: read("leaf.key") };
  } catch (error) {
    throw new Error(
      `could not make a loopback TLS certificate with the openssl CLI (is it installed? apt-get install openssl): ${
        (error as Error).message
      }`,
    );
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}
