// The scale searches behind ggml's reference quantisers (static helpers of ggml/src/ggml-quants.c),
// transcribed operation by operation in f32. Arrays are read from `x[xo ...]`; `L` receives the
// chosen levels at `L[lo ...]`.

import { nearestInt } from "./float32.js";

// a module-local alias: an imported binding is a getter call per use when the source runs unbundled (tsx, vitest)
const f = Math.fround;

/** GROUP_MAX_EPS (1e-15f). */
export const GROUP_MAX_EPS = f(1e-15);
const F0_1 = f(0.1);

/**
 * make_qx_quants for `qw == NULL`: symmetric levels in [-nmax, nmax) around a scale chosen by a
 * weighted least-squares search (`rmseType` 1: weights x^2). Returns the scale; L gets l + nmax.
 */
export function makeQxQuants(
  n: number,
  nmax: number,
  x: Float32Array,
  xo: number,
  L: Int8Array,
  lo: number,
  rmseType: number,
): number {
  let max = 0;
  let amax = 0;
  for (let i = 0; i < n; i++) {
    const ax = Math.abs(x[xo + i]!);
    if (ax > amax) {
      amax = ax;
      max = x[xo + i]!;
    }
  }
  if (amax < GROUP_MAX_EPS) {
    for (let i = 0; i < n; i++) L[lo + i] = 0;
    return 0;
  }
  let iscale = f(-nmax / max);
  if (rmseType === 0) {
    for (let i = 0; i < n; i++) {
      const l = nearestInt(f(iscale * x[xo + i]!));
      L[lo + i] = nmax + Math.max(-nmax, Math.min(nmax - 1, l));
    }
    return f(1 / iscale);
  }
  let returnEarly = false;
  if (rmseType < 0) {
    rmseType = -rmseType;
    returnEarly = true;
  }
  const weight = (v: number): number =>
    rmseType === 1 ? f(v * v) : rmseType === 2 ? 1 : rmseType === 3 ? Math.abs(v) : f(Math.sqrt(Math.abs(v)));
  let sumlx = 0;
  let suml2 = 0;
  for (let i = 0; i < n; i++) {
    const xi = x[xo + i]!;
    let l = nearestInt(f(iscale * xi));
    l = Math.max(-nmax, Math.min(nmax - 1, l));
    L[lo + i] = l + nmax;
    const w = weight(xi);
    sumlx = f(sumlx + f(f(w * xi) * l));
    suml2 = f(suml2 + f(f(w * l) * l));
  }
  let scale = suml2 !== 0 ? f(sumlx / suml2) : 0;
  if (returnEarly) return suml2 > 0 ? f(0.5 * f(scale + f(1 / iscale))) : f(1 / iscale);
  let best = f(scale * sumlx);
  for (let is = -9; is <= 9; is++) {
    if (is === 0) continue;
    iscale = f(-f(nmax + f(F0_1 * is)) / max);
    sumlx = 0;
    suml2 = 0;
    for (let i = 0; i < n; i++) {
      const xi = x[xo + i]!;
      let l = nearestInt(f(iscale * xi));
      l = Math.max(-nmax, Math.min(nmax - 1, l));
      const w = weight(xi);
      sumlx = f(sumlx + f(f(w * xi) * l));
      suml2 = f(suml2 + f(f(w * l) * l));
    }
    if (suml2 > 0 && f(sumlx * sumlx) > f(best * suml2)) {
      for (let i = 0; i < n; i++) {
        const l = nearestInt(f(iscale * x[xo + i]!));
        L[lo + i] = nmax + Math.max(-nmax, Math.min(nmax - 1, l));
      }
      scale = f(sumlx / suml2);
      best = f(scale * sumlx);
    }
  }
  return scale;
}

/** make_q3_quants: levels in [-nmax, nmax) refined coordinate-wise (do_rmse); L gets l + nmax. */
export function makeQ3Quants(
  n: number,
  nmax: number,
  x: Float32Array,
  xo: number,
  L: Int8Array,
  lo: number,
  doRmse: boolean,
): number {
  let max = 0;
  let amax = 0;
  for (let i = 0; i < n; i++) {
    const ax = Math.abs(x[xo + i]!);
    if (ax > amax) {
      amax = ax;
      max = x[xo + i]!;
    }
  }
  if (amax < GROUP_MAX_EPS) {
    for (let i = 0; i < n; i++) L[lo + i] = 0;
    return 0;
  }
  const iscale = f(-nmax / max);
  if (doRmse) {
    let sumlx = 0;
    let suml2 = 0;
    for (let i = 0; i < n; i++) {
      const xi = x[xo + i]!;
      let l = nearestInt(f(iscale * xi));
      l = Math.max(-nmax, Math.min(nmax - 1, l));
      L[lo + i] = l;
      const w = f(xi * xi);
      sumlx = f(sumlx + f(f(w * xi) * l));
      suml2 = f(suml2 + f(f(w * l) * l));
    }
    for (let itry = 0; itry < 5; itry++) {
      let nChanged = 0;
      for (let i = 0; i < n; i++) {
        const xi = x[xo + i]!;
        const li = L[lo + i]!;
        const w = f(xi * xi);
        let slx = f(sumlx - f(f(w * xi) * li));
        if (slx > 0) {
          let sl2 = f(suml2 - f(f(w * li) * li));
          let newL = nearestInt(f(f(xi * sl2) / slx));
          newL = Math.max(-nmax, Math.min(nmax - 1, newL));
          if (newL !== li) {
            slx = f(slx + f(f(w * xi) * newL));
            sl2 = f(sl2 + f(f(w * newL) * newL));
            if (sl2 > 0 && f(f(slx * slx) * suml2) > f(f(sumlx * sumlx) * sl2)) {
              L[lo + i] = newL;
              sumlx = slx;
              suml2 = sl2;
              nChanged++;
            }
          }
        }
      }
      if (!nChanged) break;
    }
    for (let i = 0; i < n; i++) L[lo + i] = L[lo + i]! + nmax;
    return suml2 > 0 ? f(sumlx / suml2) : 0;
  }
  for (let i = 0; i < n; i++) {
    let l = nearestInt(f(iscale * x[xo + i]!));
    l = Math.max(-nmax, Math.min(nmax - 1, l));
    L[lo + i] = l + nmax;
  }
  return f(1 / iscale);
}

/**
 * make_qkx2_quants: asymmetric levels in [0, nmax] with a min, searched over `nstep + 1` candidate
 * scales. Returns `[scale, theMin]` (theMin is ggml's `*the_min`, i.e. minus the offset).
 */
export function makeQkx2Quants(
  n: number,
  nmax: number,
  x: Float32Array,
  xo: number,
  weights: Float32Array,
  L: Uint8Array,
  lo: number,
  Laux: Uint8Array,
  rmin: number,
  rdelta: number,
  nstep: number,
  useMad: boolean,
): [number, number] {
  let min = x[xo]!;
  let max = x[xo]!;
  let sumW = weights[0]!;
  let sumX = f(sumW * x[xo]!);
  for (let i = 1; i < n; i++) {
    const xi = x[xo + i]!;
    if (xi < min) min = xi;
    if (xi > max) max = xi;
    const w = weights[i]!;
    sumW = f(sumW + w);
    sumX = f(sumX + f(w * xi));
  }
  if (min > 0) min = 0;
  if (max === min) {
    for (let i = 0; i < n; i++) L[lo + i] = 0;
    return [0, -min];
  }
  let iscale = f(nmax / f(max - min));
  let scale = f(1 / iscale);
  let bestError = 0;
  for (let i = 0; i < n; i++) {
    const xi = x[xo + i]!;
    const l = nearestInt(f(iscale * f(xi - min)));
    const li = Math.max(0, Math.min(nmax, l));
    L[lo + i] = li;
    let diff = f(f(f(scale * li) + min) - xi);
    diff = useMad ? Math.abs(diff) : f(diff * diff);
    bestError = f(bestError + f(weights[i]! * diff));
  }
  if (nstep < 1) return [scale, -min];
  for (let is = 0; is <= nstep; is++) {
    // `min` moves to each better candidate's offset, and later steps scale by the new range
    iscale = f(f(f(rmin + f(rdelta * is)) + nmax) / f(max - min));
    let sumL = 0;
    let sumL2 = 0;
    let sumXL = 0;
    for (let i = 0; i < n; i++) {
      const xi = x[xo + i]!;
      let l = nearestInt(f(iscale * f(xi - min)));
      l = Math.max(0, Math.min(nmax, l));
      Laux[i] = l;
      const w = weights[i]!;
      const wl = f(w * l);
      sumL = f(sumL + wl);
      sumL2 = f(sumL2 + f(wl * l));
      sumXL = f(sumXL + f(wl * xi));
    }
    const D = f(f(sumW * sumL2) - f(sumL * sumL));
    if (D > 0) {
      let thisScale = f(f(f(sumW * sumXL) - f(sumX * sumL)) / D);
      let thisMin = f(f(f(sumL2 * sumX) - f(sumL * sumXL)) / D);
      if (thisMin > 0) {
        thisMin = 0;
        thisScale = f(sumXL / sumL2);
      }
      let curError = 0;
      for (let i = 0; i < n; i++) {
        let diff = f(f(f(thisScale * Laux[i]!) + thisMin) - x[xo + i]!);
        diff = useMad ? Math.abs(diff) : f(diff * diff);
        curError = f(curError + f(weights[i]! * diff));
      }
      if (curError < bestError) {
        for (let i = 0; i < n; i++) L[lo + i] = Laux[i]!;
        bestError = curError;
        scale = thisScale;
        min = thisMin;
      }
    }
  }
  return [scale, -min];
}

/** best_index_int8: index of the table value nearest to x (table ascending, ties to the upper). */
export function bestIndexInt8(n: number, val: Int8Array, x: number): number {
  if (x <= val[0]!) return 0;
  if (x >= val[n - 1]!) return n - 1;
  let ml = 0;
  let mu = n - 1;
  while (mu - ml > 1) {
    const mav = (ml + mu) >> 1;
    if (x < val[mav]!) mu = mav;
    else ml = mav;
  }
  return f(x - val[mu - 1]!) < f(val[mu]! - x) ? mu - 1 : mu;
}
