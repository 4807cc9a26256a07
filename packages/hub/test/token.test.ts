import { createHmac } from "node:crypto";
import { AuthError, InvalidArgumentError, isMoeswarmError } from "@moeswarm/core";
import { describe, expect, it } from "vitest";
import { mintToken, principalOf, verifyToken } from "../src/index.js";

const SECRET = "token-test-secret-0123456789abcdef";
const NOW = Date.UTC(2030, 0, 1);

function codeOf(fn: () => unknown): string | undefined {
  try {
    fn();
  } catch (error) {
    return isMoeswarmError(error) ? error.code : String(error);
  }
  return undefined;
}

describe("tokens", () => {
  it("mints a compact token whose claims verify", () => {
    const token = mintToken({ role: "worker", id: "phone-1", ttlS: 3600, now: NOW }, SECRET);
    expect(token).toMatch(/^msw1\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]{43}$/);
    const payload = JSON.parse(Buffer.from(token.split(".")[1]!, "base64url").toString());
    expect(payload).toEqual({ r: "worker", sub: "phone-1", iat: NOW / 1000, exp: NOW / 1000 + 3600 });
    expect(verifyToken(token, SECRET, { role: "worker", id: "phone-1", now: NOW + 1000 })).toEqual({
      role: "worker",
      id: "phone-1",
      iat: NOW / 1000,
      exp: NOW / 1000 + 3600,
    });
  });

  it("carries the identity's principal (`own`), the id when absent", () => {
    const token = mintToken({ role: "worker", id: "phone-1", owner: "alice", ttlS: 60, now: NOW }, SECRET);
    const payload = JSON.parse(Buffer.from(token.split(".")[1]!, "base64url").toString());
    expect(payload.own).toBe("alice");
    expect(verifyToken(token, SECRET, { now: NOW }).owner).toBe("alice");
    expect(principalOf(verifyToken(token, SECRET, { now: NOW }), "x")).toBe("alice");
    const plain = mintToken({ role: "worker", id: "phone-2", ttlS: 60, now: NOW }, SECRET);
    expect(principalOf(verifyToken(plain, SECRET, { now: NOW }), "x")).toBe("phone-2");
    expect(codeOf(() => mintToken({ role: "worker", id: "p", owner: "", ttlS: 60 }, SECRET))).toBe(
      "MOESWARM_INVALID_ARGUMENT",
    );
  });

  it("signs with HMAC-SHA256 over the prefix and claims (checked against node:crypto by hand)", () => {
    const token = mintToken({ role: "backbone", ttlS: 60, now: NOW }, SECRET);
    const [prefix, claims, sig] = token.split(".");
    const expected = createHmac("sha256", SECRET).update(`${prefix}.${claims}`).digest("base64url");
    expect(sig).toBe(expected);
  });

  it("refuses tampering, expiry, the wrong role or id, and junk", () => {
    const token = mintToken({ role: "worker", id: "w", ttlS: 60, now: NOW }, SECRET);
    const [prefix, claims, sig] = token.split(".") as [string, string, string];
    const forged = Buffer.from(
      JSON.stringify({ r: "admin", iat: NOW / 1000, exp: NOW / 1000 + 60 }),
    ).toString("base64url");
    expect(codeOf(() => verifyToken(`${prefix}.${forged}.${sig}`, SECRET, { now: NOW }))).toBe(
      "MOESWARM_AUTH_INVALID",
    );
    expect(codeOf(() => verifyToken(token, "some-other-secret-0123456789", { now: NOW }))).toBe(
      "MOESWARM_AUTH_INVALID",
    );
    expect(codeOf(() => verifyToken(token, SECRET, { now: NOW + 60_000 }))).toBe("MOESWARM_AUTH_EXPIRED");
    expect(verifyToken(token, SECRET, { now: NOW + 60_000, leewayS: 5 }).role).toBe("worker");
    expect(codeOf(() => verifyToken(token, SECRET, { now: NOW, role: "backbone" }))).toBe(
      "MOESWARM_AUTH_ROLE",
    );
    expect(codeOf(() => verifyToken(token, SECRET, { now: NOW, role: "admin" }))).toBe("MOESWARM_AUTH_ROLE");
    expect(codeOf(() => verifyToken(token, SECRET, { now: NOW, id: "other" }))).toBe("MOESWARM_AUTH_ROLE");
    expect(codeOf(() => verifyToken("", SECRET))).toBe("MOESWARM_AUTH_MISSING");
    expect(codeOf(() => verifyToken(undefined, SECRET))).toBe("MOESWARM_AUTH_MISSING");
    for (const junk of [
      42,
      "msw1.",
      "msw1..",
      "abc.def.ghi",
      `msw1.${claims}`,
      `${token}x`,
      "msw1.".padEnd(5000, "a"),
    ]) {
      expect(codeOf(() => verifyToken(junk, SECRET, { now: NOW }))).toBe("MOESWARM_AUTH_INVALID");
    }
    // a correctly signed body that is not JSON claims
    const body = `msw1.${Buffer.from("[1,2]").toString("base64url")}`;
    const signed = `${body}.${createHmac("sha256", SECRET).update(body).digest("base64url")}`;
    expect(codeOf(() => verifyToken(signed, SECRET))).toBe("MOESWARM_AUTH_INVALID");
  });

  it("lets an admin token act as any role and verifies during a secret rotation", () => {
    const admin = mintToken({ role: "admin", ttlS: 60, now: NOW }, SECRET);
    expect(verifyToken(admin, SECRET, { now: NOW, role: "worker" }).role).toBe("admin");
    expect(verifyToken(admin, SECRET, { now: NOW, role: "backbone" }).role).toBe("admin");
    const next = "the-next-secret-0123456789abcdef";
    const old = mintToken({ role: "worker", ttlS: 60, now: NOW }, SECRET);
    expect(verifyToken(old, [next, SECRET], { now: NOW }).role).toBe("worker");
    expect(codeOf(() => verifyToken(old, [next], { now: NOW }))).toBe("MOESWARM_AUTH_INVALID");
  });

  it("validates its arguments eagerly", () => {
    const e = codeOf(() => mintToken({ role: "worker", ttlS: 60 }, "short"));
    expect(e).toBe("MOESWARM_INVALID_ARGUMENT");
    expect(() => mintToken({ role: "root" as "admin", ttlS: 60 }, SECRET)).toThrow(InvalidArgumentError);
    expect(() => mintToken({ role: "worker", ttlS: 0 }, SECRET)).toThrow(InvalidArgumentError);
    expect(() => mintToken({ role: "worker", ttlS: 60, id: "" }, SECRET)).toThrow(InvalidArgumentError);
    expect(() => verifyToken("x", [] as string[])).toThrow(InvalidArgumentError);
    expect(() => verifyToken("x", undefined as unknown as string)).toThrow(InvalidArgumentError);
    expect(new AuthError("MOESWARM_AUTH_MISSING")).toBeInstanceOf(AuthError);
  });
});
