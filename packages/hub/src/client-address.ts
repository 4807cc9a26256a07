// The address a connection is counted under for the per-address limits. Behind a reverse proxy
// every connection comes from the proxy, so one busy client would exhaust the proxy's share for
// all; the proxy names the client in X-Forwarded-For. That header is believed only on
// connections from the proxies the operator listed (`trustProxy`): from anyone else it is
// whatever the client wrote, and ignored.
import type { IncomingMessage } from "node:http";
import { BlockList, isIP } from "node:net";
import { InvalidArgumentError } from "@moeswarm/core";

/** The proxies the hub trusts, checked (`checkTrustProxy`). */
export interface TrustedProxies {
  readonly list: readonly string[];
  has(address: string): boolean;
}

/** "::ffff:10.0.0.1" (an IPv4 peer on a dual-stack socket) as "10.0.0.1". */
export function plainAddress(address: string): string {
  const m = /^::ffff:(\d+\.\d+\.\d+\.\d+)$/i.exec(address);
  return m ? (m[1] as string) : address;
}

/** Checks `trustProxy` (addresses or CIDR blocks) into a lookup; InvalidArgumentError names a bad entry. */
export function checkTrustProxy(list: readonly string[] | undefined): TrustedProxies | undefined {
  if (list === undefined || list.length === 0) return undefined;
  if (!Array.isArray(list))
    throw new InvalidArgumentError("hub option trustProxy must be an array of addresses");
  const blocks = new BlockList();
  for (const entry of list) {
    const [address, bits, extra] = typeof entry === "string" ? entry.trim().split("/") : [];
    const family = isIP(address ?? "");
    const prefix = bits === undefined ? undefined : Number(bits);
    const max = family === 6 ? 128 : 32;
    if (
      family === 0 ||
      extra !== undefined ||
      (prefix !== undefined && (!/^\d+$/.test(bits as string) || (prefix as number) > max))
    ) {
      throw new InvalidArgumentError(
        `trustProxy entry ${JSON.stringify(entry)} is not an IP address or CIDR block (e.g. 127.0.0.1, 10.0.0.0/8, ::1)`,
      );
    }
    const type = family === 6 ? "ipv6" : "ipv4";
    if (prefix === undefined) blocks.addAddress(address as string, type);
    else blocks.addSubnet(address as string, prefix, type);
  }
  return {
    list: [...list],
    has(address) {
      const a = plainAddress(address);
      const family = isIP(a);
      return family !== 0 && blocks.check(a, family === 6 ? "ipv6" : "ipv4");
    },
  };
}

/**
 * Who sent `req`: the TCP peer, or, when the peer is a trusted proxy, the right-most address of
 * X-Forwarded-For that is not itself a trusted proxy (each proxy appends the address it saw, so
 * entries left of the first untrusted one may be made up). `proxy` is the peer in that case.
 */
export function clientAddress(
  req: IncomingMessage,
  trusted: TrustedProxies | undefined,
): { address: string; proxy?: string } {
  const peer = plainAddress(req.socket.remoteAddress ?? "?");
  if (!trusted?.has(peer)) return { address: peer };
  const header = req.headers["x-forwarded-for"];
  const hops = (Array.isArray(header) ? header.join(",") : (header ?? ""))
    .split(",")
    .map((h) => plainAddress(h.trim()))
    .filter((h) => h.length > 0);
  for (let i = hops.length - 1; i >= 0; i--) {
    const hop = hops[i] as string;
    if (isIP(hop) === 0) break; // garbage: stop believing the header here
    if (!trusted.has(hop) || i === 0) return { address: hop, proxy: peer };
  }
  return { address: peer };
}
