// The per-address connection cap behind a trusted proxy: the proxy's connections are not capped
// as one address; each request counts under the client X-Forwarded-For names, and a client over
// its cap has its connection closed before the hub does anything with the request.
import { connect, type Socket } from "node:net";
import { afterEach, describe, expect, it } from "vitest";
import { createHub, type Hub } from "../src/index.js";

let hub: Hub | undefined;
afterEach(async () => {
  await hub?.close();
  hub = undefined;
});

/** A request whose headers the hub has taken (it answered 100 Continue) and whose body never comes. */
function heldRequest(port: number, forwardedFor: string): Promise<{ socket: Socket; answered: string }> {
  return new Promise((resolve, reject) => {
    const socket = connect(port, "127.0.0.1");
    let answered = "";
    socket.on("error", () => {});
    socket.on("data", (c) => {
      answered += c.toString();
      if (answered.includes("\r\n\r\n")) resolve({ socket, answered });
    });
    socket.on("close", () => resolve({ socket, answered }));
    socket.on("connect", () =>
      socket.write(
        `POST /api/claims HTTP/1.1\r\nHost: hub\r\nX-Forwarded-For: ${forwardedFor}\r\nContent-Type: application/json\r\nContent-Length: 100\r\nExpect: 100-continue\r\n\r\n`,
      ),
    );
    setTimeout(() => reject(new Error("no answer")), 10_000).unref();
  });
}

describe("trustProxy and the per-address cap", () => {
  it("counts a trusted proxy's connections under their clients, and closes a client's over its cap", async () => {
    hub = createHub({
      secret: "trust-proxy-test-secret-0123456789",
      trustProxy: ["127.0.0.1"],
      limits: { maxConnectionsPerAddress: 2 },
    });
    const { port, url } = await hub.listen(0, "127.0.0.1");
    // two held requests of one client, through the "proxy" (every TCP connection is from 127.0.0.1)
    const a = await heldRequest(port, "198.51.100.1");
    const b = await heldRequest(port, "198.51.100.1");
    expect([a.answered, b.answered].map((t) => t.split("\r\n")[0])).toEqual([
      "HTTP/1.1 100 Continue",
      "HTTP/1.1 100 Continue",
    ]);
    // its third: closed without an answer (node says 100 Continue before the guard sees the request)
    const c = await heldRequest(port, "198.51.100.1");
    if (!c.socket.destroyed) await new Promise((r) => c.socket.once("close", r));
    expect(c.answered.replace("HTTP/1.1 100 Continue\r\n\r\n", "")).toBe("");
    // another client through the same proxy: its own allowance (the proxy holds 3 connections > 2)
    const res = await fetch(`${url}/api/health`, { headers: { "x-forwarded-for": "198.51.100.2" } });
    expect(await res.json()).toMatchObject({ client: { address: "198.51.100.2", proxy: "127.0.0.1" } });
    const metrics = await (await fetch(`${url}/metrics`)).text();
    expect(metrics).toMatch(/moeswarm_hub_connections_refused_total\{reason="address-cap"\} 1\b/);
    // the client's allowance comes back when its requests end
    a.socket.destroy();
    b.socket.destroy();
    await new Promise((r) => setTimeout(r, 50));
    const d = await heldRequest(port, "198.51.100.1");
    expect(d.answered.split("\r\n")[0]).toBe("HTTP/1.1 100 Continue");
    d.socket.destroy();
  });

  it("refuses a bad trustProxy entry up front", () => {
    expect(() =>
      createHub({ secret: "trust-proxy-test-secret-0123456789", trustProxy: ["hub.example.org"] }),
    ).toThrow(expect.objectContaining({ code: "MOESWARM_INVALID_ARGUMENT" }));
  });
});
