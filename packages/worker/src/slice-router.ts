import { InvalidArgumentError, type Range, sumSlots } from "@moeswarm/core";
import {
  checkRunRequest,
  type ExpertCompute,
  type RunOptions,
  type RunRequest,
} from "@moeswarm/worker-native";

/** One slice a worker serves: a rectangle of layers x experts, computed by its own ExpertCompute. */
export interface RoutedSlice {
  readonly layers: Range;
  readonly experts: Range;
  readonly compute: ExpertCompute;
}

/**
 * A run's answer: `values` floats, written into memory given to `write` (which writes every one).
 * Without `y`, `write` may compute the answer (a request the compute runs inline): it throws what
 * the compute's run would reject with.
 */
export interface RunOutput {
  /** The answer as an array, when it is one already. */
  readonly y?: Float32Array;
  readonly values: number;
  write(out: Float32Array): void;
}

/**
 * The slices a worker serves of one model, behind one `run`: a dispatch's slots may fall in
 * several of them (a backbone groups a layer's slots by worker, not by slice).
 *
 * Slots that all fall in one slice go to its compute unchanged. Otherwise each slice computes its
 * own slots in mode "each" (the others masked as empty, -1), the rows are put back in slot order,
 * and mode "sum" is reduced afterwards with core's `sumSlots`: products rounded to f32 and added in
 * slot order, as protocol v1 and one compute over the whole layer do, so the bits are the same.
 */
export class SliceRouter {
  readonly model: string;
  readonly #slices: RoutedSlice[] = [];

  constructor(model: string) {
    this.model = model;
  }

  get size(): number {
    return this.#slices.length;
  }

  get nEmbd(): number | undefined {
    return this.#slices[0]?.compute.info.nEmbd;
  }

  /** Layers served, ascending (each once). */
  layers(): number[] {
    const set = new Set<number>();
    for (const s of this.#slices) for (let l = s.layers.start; l < s.layers.end; l++) set.add(l);
    return [...set].sort((a, b) => a - b);
  }

  add(slice: RoutedSlice): void {
    const nEmbd = this.nEmbd;
    if (nEmbd !== undefined && slice.compute.info.nEmbd !== nEmbd) {
      throw new InvalidArgumentError(
        `a slice of ${this.model} with n_embd ${slice.compute.info.nEmbd} cannot join slices with n_embd ${nEmbd}`,
      );
    }
    this.#slices.push(slice);
  }

  /** Forgets the slice computed by `compute` (one that could not be registered). */
  remove(compute: ExpertCompute): void {
    const i = this.#slices.findIndex((s) => s.compute === compute);
    if (i >= 0) this.#slices.splice(i, 1);
  }

  async run(request: RunRequest, options: RunOptions = {}): Promise<Float32Array> {
    const output = await this.runOutput(request, options);
    if (output.y) return output.y;
    const y = new Float32Array(output.values);
    output.write(y);
    return y;
  }

  /**
   * `run`, with the last step of a dispatch split over slices (the rows put back in slot order,
   * or their router-weighted sum) left to `write`, which writes the answer into memory it is
   * given: the outgoing result frame's (relay-client's respondInto), without an array of its
   * own. `y` is set when the answer is an array already (one slice computed it all).
   */
  async runOutput(request: RunRequest, options: RunOptions = {}): Promise<RunOutput> {
    const { layer, k, mode } = request;
    const here = this.#slices.filter((s) => layer >= s.layers.start && layer < s.layers.end);
    const experts = new Set<number>();
    for (const s of here) for (let e = s.experts.start; e < s.experts.end; e++) experts.add(e);
    // the whole request against the union of the slices: the same typed errors as one compute gives
    // (q8 rows pass: each slice's compute takes or refuses them)
    const n = checkRunRequest(request, { layers: this.layers(), nEmbd: this.nEmbd ?? 0 }, experts, {
      quantized: true,
    });
    const ids = request.ids;
    const owner = new Int32Array(ids.length).fill(-1);
    const used: number[] = [];
    for (let i = 0; i < ids.length; i++) {
      const id = ids[i] as number;
      if (id === -1) continue;
      // the first slice that holds it (a worker's slices do not overlap; if they did, one is enough)
      let s = 0;
      while (!(id >= (here[s] as RoutedSlice).experts.start && id < (here[s] as RoutedSlice).experts.end))
        s++;
      owner[i] = s;
      if (!used.includes(s)) used.push(s);
    }
    const embd = this.nEmbd as number;
    if (used.length <= 1) {
      const compute = (here[used[0] ?? 0] as RoutedSlice).compute;
      // a request the compute would run inline is computed by `write`, straight into the memory
      // it is given (the result frame's): no array of its own, no copy
      if (compute.runSyncInto && compute.runsInline?.(request) === true && !options.signal?.aborted) {
        const runSyncInto = compute.runSyncInto.bind(compute);
        return { values: (mode === "each" ? n * k : n) * embd, write: (out) => runSyncInto(request, out) };
      }
      const y = await compute.run(request, options);
      return { y, values: y.length, write: (out) => out.set(y) };
    }
    const parts = await this.#split(request, here, owner, used, options);
    const rows = (out: Float32Array) => {
      // every slot's row: its slice's, or zeros for an empty slot (the memory may hold old bytes)
      for (let i = 0; i < ids.length; i++) {
        const s = owner[i] as number;
        if (s < 0) out.fill(0, i * embd, (i + 1) * embd);
        else out.set((parts[used.indexOf(s)] as Float32Array).subarray(i * embd, (i + 1) * embd), i * embd);
      }
    };
    if (mode === "each") return { values: n * k * embd, write: rows };
    const each = new Float32Array(n * k * embd);
    rows(each);
    return {
      values: n * embd,
      write: (out) => sumSlots(each, request.w as Float32Array, ids, { n, k, embd }, out),
    };
  }

  /** Each used slice's answer (mode "each") to its own slots, the others masked as empty. */
  #split(
    request: RunRequest,
    here: readonly RoutedSlice[],
    owner: Int32Array,
    used: readonly number[],
    options: RunOptions,
  ): Promise<Float32Array[]> {
    const { ids, k } = request;
    return Promise.all(
      used.map((s) => {
        const mine = Int32Array.from(ids, (id, i) => (owner[i] === s ? id : -1));
        return (here[s] as RoutedSlice).compute.run(
          {
            layer: request.layer,
            x: request.x,
            ...(request.xType !== undefined ? { xType: request.xType } : {}),
            ids: mine,
            k,
            mode: "each",
          },
          options,
        );
      }),
    );
  }
}
