import { HubError } from "@moeswarm/core";

/** What to send of a resource of `length` bytes: all of it, or one byte range `[start, end)`. */
export type RangeAnswer = { kind: "full" } | { kind: "partial"; start: number; end: number };

const SPEC = /^(\d*)-(\d*)$/;

/**
 * Interprets a `Range` header (RFC 9110 section 14) for a resource of `length` bytes. One byte
 * range is served as a 206; what this server may ignore is served whole (several ranges, another
 * unit, a malformed header), as the RFC allows. A range that starts at or past the end (or an
 * empty suffix) is unsatisfiable: HubError MOESWARM_HUB_RANGE_NOT_SATISFIABLE, answered 416
 * with `Content-Range: bytes *\/length`.
 */
export function interpretRange(header: string | undefined, length: number): RangeAnswer {
  if (header === undefined) return { kind: "full" };
  const eq = header.indexOf("=");
  if (eq < 0 || header.slice(0, eq).trim().toLowerCase() !== "bytes") return { kind: "full" };
  const specs = header.slice(eq + 1).split(",");
  if (specs.length !== 1) return { kind: "full" };
  const m = SPEC.exec((specs[0] as string).trim());
  if (!m) return { kind: "full" };
  const [, first = "", last = ""] = m;
  const unsatisfiable = () =>
    new HubError(
      "MOESWARM_HUB_RANGE_NOT_SATISFIABLE",
      `range ${JSON.stringify(header)} is outside the ${length}-byte resource`,
      { details: { length } },
    );
  // Digits beyond 2^53 are simply "very large": past any end.
  const num = (digits: string) => (digits.length > 15 ? Number.MAX_SAFE_INTEGER : Number(digits));
  if (first === "") {
    if (last === "") return { kind: "full" };
    const suffix = num(last);
    if (suffix === 0 || length === 0) throw unsatisfiable();
    return { kind: "partial", start: Math.max(0, length - suffix), end: length };
  }
  const start = num(first);
  if (last !== "" && num(last) < start) return { kind: "full" }; // invalid spec: ignored
  if (start >= length) throw unsatisfiable();
  const end = last === "" ? length : Math.min(length, num(last) + 1);
  return { kind: "partial", start, end };
}

/**
 * True when a request's `If-Range` lets its `Range` apply: absent, or the current strong ETag.
 * A date or another (or weak) tag means the client's partial copy may be stale: send it all.
 */
export function ifRangeHolds(ifRange: string | undefined, etag: string): boolean {
  return ifRange === undefined || ifRange.trim() === etag;
}

/** True when `If-None-Match` matches the ETag (weak comparison, as RFC 9110 13.1.2 says). */
export function noneMatchHits(ifNoneMatch: string | undefined, etag: string): boolean {
  if (ifNoneMatch === undefined) return false;
  const opaque = (tag: string) => tag.trim().replace(/^W\//, "");
  const want = opaque(etag);
  return ifNoneMatch.split(",").some((t) => t.trim() === "*" || opaque(t) === want);
}
