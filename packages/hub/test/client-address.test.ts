// X-Forwarded-For is believed only from a listed proxy, and then only up to the first hop that is
// not itself a trusted proxy (entries further left are whatever the client wrote).
import type { IncomingMessage } from "node:http";
import { describe, expect, it } from "vitest";
import { checkTrustProxy, clientAddress } from "../src/client-address.js";

const req = (peer: string, xff?: string | string[]) =>
  ({
    socket: { remoteAddress: peer },
    headers: xff === undefined ? {} : { "x-forwarded-for": xff },
  }) as unknown as IncomingMessage;

describe("clientAddress", () => {
  const trusted = checkTrustProxy(["127.0.0.1", "10.0.0.0/8", "fd00::/8"]);

  it("is the TCP peer without trusted proxies, whatever the header says", () => {
    expect(clientAddress(req("203.0.113.7", "198.51.100.1"), undefined)).toEqual({ address: "203.0.113.7" });
    expect(clientAddress(req("203.0.113.7", "198.51.100.1"), trusted)).toEqual({ address: "203.0.113.7" });
  });

  it("takes the client from a trusted proxy's header", () => {
    expect(clientAddress(req("127.0.0.1", "198.51.100.1"), trusted)).toEqual({
      address: "198.51.100.1",
      proxy: "127.0.0.1",
    });
    // a dual-stack socket's form of an IPv4 peer
    expect(clientAddress(req("::ffff:127.0.0.1", "198.51.100.1"), trusted)).toEqual({
      address: "198.51.100.1",
      proxy: "127.0.0.1",
    });
  });

  it("skips trusted hops from the right and ignores what the client prepended", () => {
    // client sent "1.2.3.4" itself; nginx appended its peer 198.51.100.1; a balancer 10.1.2.3 appended nginx's
    expect(clientAddress(req("127.0.0.1", "1.2.3.4, 198.51.100.1, 10.1.2.3"), trusted)).toEqual({
      address: "198.51.100.1",
      proxy: "127.0.0.1",
    });
    expect(clientAddress(req("127.0.0.1", ["1.2.3.4", "2001:db8::5"]), trusted).address).toBe("2001:db8::5");
    // every hop trusted: the left-most
    expect(clientAddress(req("127.0.0.1", "10.0.0.9, 10.0.0.8"), trusted).address).toBe("10.0.0.9");
  });

  it("falls back to the proxy's own address when the header is missing or not an address", () => {
    expect(clientAddress(req("127.0.0.1"), trusted)).toEqual({ address: "127.0.0.1" });
    expect(clientAddress(req("127.0.0.1", "unknown"), trusted)).toEqual({ address: "127.0.0.1" });
  });
});

describe("checkTrustProxy", () => {
  it("takes addresses and CIDR blocks of both families", () => {
    const t = checkTrustProxy(["192.168.1.0/24", "::1", "fd00::/8"]);
    expect(["192.168.1.77", "::1", "fd12::1"].map((a) => t?.has(a))).toEqual([true, true, true]);
    expect(["192.168.2.1", "::2", "fe80::1", "garbage"].map((a) => t?.has(a))).toEqual([
      false,
      false,
      false,
      false,
    ]);
    expect(checkTrustProxy([])).toBeUndefined();
  });

  it.each(["localhost", "10.0.0.0/33", "10.0.0.1/8/1", "::1/129", "10.0.0.0/x", ""])(
    "refuses %j",
    (entry) => {
      expect(() => checkTrustProxy([entry])).toThrow(
        expect.objectContaining({ code: "MOESWARM_INVALID_ARGUMENT" }),
      );
    },
  );
});
