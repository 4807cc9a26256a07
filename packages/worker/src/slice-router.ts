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

interface LayerSlices {
  readonly here: readonly RoutedSlice[];
  readonly experts: ReadonlySet<number>;
}

interface Route {
  readonly n: number;
  /** The answer's values: n*k*embd for mode "each", n*embd for "sum". */
  readonly values: number;
  readonly here: readonly RoutedSlice[];
  /** The one compute that computes every filled slot (all of the request as it is). */
  readonly single: ExpertCompute | undefined;
}

/** A request `compute` runs inline, as a RunOutput whose `write` computes it; else undefined. */
function inlineOf(compute: ExpertCompute, request: RunRequest, values: number): RunOutput | undefined {
  if (!compute.runSyncInto || compute.runsInline?.(request) !== true) return undefined;
  return new InlineOutput(compute, request, values);
}

/** An inline compute's answer written by `write` into the memory given (no closure of its own). */
class InlineOutput implements RunOutput {
  constructor(
    readonly compute: ExpertCompute,
    readonly request: RunRequest,
    readonly values: number,
  ) {}

  write(out: Float32Array): void {
    (this.compute.runSyncInto as NonNullable<ExpertCompute["runSyncInto"]>).call(
      this.compute,
      this.request,
      out,
    );
  }
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
  /** Per layer: its slices and the union of their experts; the layers served. Made on first use. */
  readonly #byLayer = new Map<number, LayerSlices>();
  #layers: number[] | undefined;

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
    return [...this.#layersServed()];
  }

  #layersServed(): number[] {
    if (this.#layers === undefined) {
      const set = new Set<number>();
      for (const s of this.#slices) for (let l = s.layers.start; l < s.layers.end; l++) set.add(l);
      this.#layers = [...set].sort((a, b) => a - b);
    }
    return this.#layers;
  }

  /**
   * The layers that one slice alone holds, with its compute (ascending): what the native
   * listener may serve (a layer spread over several slices needs the combine of runOutput).
   */
  soleSlices(): Array<{ layer: number; compute: ExpertCompute }> {
    const out: Array<{ layer: number; compute: ExpertCompute }> = [];
    for (const layer of this.#layersServed()) {
      const { here } = this.#slicesOf(layer);
      if (here.length === 1) out.push({ layer, compute: (here[0] as RoutedSlice).compute });
    }
    return out;
  }

  add(slice: RoutedSlice): void {
    const nEmbd = this.nEmbd;
    if (nEmbd !== undefined && slice.compute.info.nEmbd !== nEmbd) {
      throw new InvalidArgumentError(
        `a slice of ${this.model} with n_embd ${slice.compute.info.nEmbd} cannot join slices with n_embd ${nEmbd}`,
      );
    }
    this.#slices.push(slice);
    this.#changed();
  }

  /** Forgets the slice computed by `compute` (one that could not be registered). */
  remove(compute: ExpertCompute): void {
    const i = this.#slices.findIndex((s) => s.compute === compute);
    if (i >= 0) this.#slices.splice(i, 1);
    this.#changed();
  }

  #changed(): void {
    this.#byLayer.clear();
    this.#layers = undefined;
  }

  /** The slices holding `layer` and their experts (none for a layer not served). */
  #slicesOf(layer: number): LayerSlices {
    let at = this.#byLayer.get(layer);
    if (at === undefined) {
      const here = this.#slices.filter((s) => layer >= s.layers.start && layer < s.layers.end);
      const experts = new Set<number>();
      for (const s of here) for (let e = s.experts.start; e < s.experts.end; e++) experts.add(e);
      at = { here, experts };
      // only layers served are kept (a request for another one is refused: nothing to cache)
      if (here.length > 0) this.#byLayer.set(layer, at);
    }
    return at;
  }

  async run(request: RunRequest, options: RunOptions = {}): Promise<Float32Array> {
    const output = await this.runOutput(request, options);
    if (output.y) return output.y;
    const y = new Float32Array(output.values);
    output.write(y);
    return y;
  }

  /**
   * runOutput's answer, without a promise, for a request one slice's compute runs inline (a
   * small one): `write` computes it straight into the memory it is given. Undefined for any other
   * request (runOutput has it). Throws runOutput's typed errors for a request it refuses.
   */
  inlineOutput(request: RunRequest): RunOutput | undefined {
    const route = this.#route(request);
    return route.single === undefined ? undefined : inlineOf(route.single, request, route.values);
  }

  /**
   * `run`, with the last step of a dispatch split over slices (the rows put back in slot order,
   * or their router-weighted sum) left to `write`, which writes the answer into memory it is
   * given: the outgoing result frame's (relay-client's respondInto), without an array of its
   * own. `y` is set when the answer is an array already (one slice computed it all).
   */
  async runOutput(request: RunRequest, options: RunOptions = {}): Promise<RunOutput> {
    const { n, values, here, single } = this.#route(request);
    if (single !== undefined) {
      // a request the compute would run inline is computed by `write`, straight into the memory
      // it is given (the result frame's): no array of its own, no copy
      const inline = options.signal?.aborted ? undefined : inlineOf(single, request, values);
      if (inline) return inline;
      const y = await single.run(request, options);
      return { y, values: y.length, write: (out) => out.set(y) };
    }
    const { ids, k, mode } = request;
    const embd = this.nEmbd as number;
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
    // (two slices or more: #route found no single one)
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

  /**
   * The request checked against the union of the layer's slices (the same typed errors as one
   * compute gives; q8 rows pass: each slice's compute takes or refuses them), its token count,
   * its answer's values, and the one compute that holds every slot it fills, when one does.
   */
  #route(request: RunRequest): Route {
    const { here, experts } = this.#slicesOf(request.layer);
    const embd = this.nEmbd ?? 0;
    const n = checkRunRequest(request, { layers: this.#layersServed(), nEmbd: embd }, experts, {
      quantized: true,
    });
    const values = (request.mode === "each" ? n * request.k : n) * embd;
    if (here.length === 1) return { n, values, here, single: (here[0] as RoutedSlice).compute };
    // several slices hold the layer: one compute still does when every filled slot is its own
    const ids = request.ids;
    let one: RoutedSlice | undefined;
    for (let i = 0; i < ids.length; i++) {
      const id = ids[i] as number;
      if (id === -1) continue;
      if (one !== undefined && id >= one.experts.start && id < one.experts.end) continue;
      const s = here.find((h) => id >= h.experts.start && id < h.experts.end) as RoutedSlice;
      if (one !== undefined && s !== one) return { n, values, here, single: undefined };
      one = s;
    }
    return { n, values, here, single: (one ?? (here[0] as RoutedSlice)).compute };
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
