import { GgufError, throwIfAborted } from "@moeswarm/core";
import { type ByteSourceInput, openByteSource } from "./byte-source.js";
import { GgufValueType } from "./gguf-constants.js";
import { type GgufHeader, readGguf } from "./gguf-reader.js";
import type { SliceManifest } from "./manifest.js";
import { findExpertTensors, type MoeLayout, SLICE_KEYS } from "./moe-tensors.js";
import { sliceContents } from "./slice.js";
import { checkChunkSize, readRanges, SlabHasher } from "./slice-io.js";

export interface VerifySliceOptions {
  signal?: AbortSignal;
  /** Read size in bytes (default 8 MiB). */
  chunkSize?: number;
}

export interface VerifiedSlice {
  readonly source: string;
  readonly layers: readonly number[];
  readonly experts: readonly number[];
  /** Slabs checked. */
  readonly slabs: number;
  /** Bytes of tensor data hashed. */
  readonly bytes: number;
}

function mismatch(message: string, details: Record<string, unknown>): GgufError {
  return new GgufError("MOESWARM_SLICE_MISMATCH", message, { details });
}

/** The slice's listed contents, embedded slab sha256s and expert layout, checked against each other. */
function sliceStructure(header: GgufHeader, description: string) {
  if (!header.metadata.has(SLICE_KEYS.experts)) {
    throw mismatch(`${description} is not a slice: it has no ${SLICE_KEYS.experts}`, {});
  }
  const contents = sliceContents(header);
  const embeddedValue = header.metadata.get(SLICE_KEYS.slabSha256);
  if (embeddedValue?.type !== GgufValueType.ARRAY || embeddedValue.itemType !== GgufValueType.STRING) {
    throw mismatch(`${SLICE_KEYS.slabSha256} is missing or not arr[str]`, {});
  }
  const embedded = embeddedValue.value;
  let layout: ReturnType<typeof findExpertTensors>;
  try {
    layout = findExpertTensors(header);
  } catch (error) {
    if (error instanceof GgufError && error.code === "MOESWARM_GGUF_NOT_MOE") {
      throw mismatch(error.message, { ...error.details });
    }
    throw error;
  }
  const sliceLayers = layout.layers.map((l) => l.layer);
  if (sliceLayers.join(",") !== contents.layers.join(",")) {
    throw mismatch(`the slice lists layers [${contents.layers}] but holds experts of [${sliceLayers}]`, {
      listed: contents.layers,
      held: sliceLayers,
    });
  }
  const nSlabs = layout.layers.reduce((n, l) => n + l.tensors.length * l.nExpert, 0);
  if (embedded.length !== nSlabs) {
    throw mismatch(`${SLICE_KEYS.slabSha256} has ${embedded.length} entries for ${nSlabs} slabs`, {
      entries: embedded.length,
      slabs: nSlabs,
    });
  }
  return { contents, embedded, layout };
}

/** The slice's source, layers, experts and tensors against the model's manifest. */
function checkAgainstManifest(
  layout: MoeLayout,
  contents: ReturnType<typeof sliceContents>,
  manifest: SliceManifest,
): void {
  if (contents.sourceSha256 !== manifest.source.headerSha256) {
    throw mismatch(
      `the slice was cut from another model (source header sha256 ${contents.sourceSha256}, manifest ${manifest.source.headerSha256})`,
      {
        expected: manifest.source.headerSha256,
        actual: contents.sourceSha256,
      },
    );
  }
  for (const l of layout.layers) {
    const ml = manifest.layers.find((x) => x.layer === l.layer);
    if (!ml) throw mismatch(`layer ${l.layer} has no routed experts in the manifest`, { layer: l.layer });
    for (const e of contents.experts) {
      if (e >= ml.nExpert)
        throw mismatch(`expert ${e} is beyond the model's ${ml.nExpert}`, { layer: l.layer, expert: e });
    }
    for (const mt of ml.tensors) {
      const t = l.tensors.find((x) => x.name === mt.name);
      if (!t)
        throw mismatch(`tensor ${mt.name} is missing from the slice`, {
          layer: l.layer,
          tensor: mt.name,
        });
      const want = [...mt.shape];
      want[want.length - 1] = contents.experts.length;
      if (t.info.type !== mt.type || t.info.shape.join(",") !== want.join(",")) {
        throw mismatch(
          `tensor ${t.name} has type ${t.info.type} shape [${t.info.shape}], the manifest says ${mt.type} [${want}]`,
          {
            layer: l.layer,
            tensor: t.name,
          },
        );
      }
    }
    if (l.tensors.length !== ml.tensors.length) {
      const extra = l.tensors.find((t) => !ml.tensors.some((mt) => mt.name === t.name));
      throw mismatch(`tensor ${extra?.name} is not in the manifest`, {
        layer: l.layer,
        tensor: extra?.name,
      });
    }
  }
}

/**
 * Checks every slab of a slice: its sha256 against the slice's own `moeswarm.slice.slab_sha256`
 * and, with a manifest, against the model's (and the slice's source header sha256, tensor names,
 * types and shapes against the manifest). Reads the slice once in bounded chunks. Throws GgufError
 * MOESWARM_SLICE_MISMATCH naming the first bad slab (layer, expert, tensor, expected and actual
 * sha256, offset in the slice).
 */
export async function verifySlice(
  input: ByteSourceInput,
  manifest?: SliceManifest,
  options: VerifySliceOptions = {},
): Promise<VerifiedSlice> {
  const { signal } = options;
  const chunkSize = checkChunkSize(options.chunkSize);
  throwIfAborted(signal);
  const { source, owned } = await openByteSource(input, { signal });
  try {
    const header = await readGguf(source, { signal });
    const { contents, embedded, layout } = sliceStructure(header, source.description);
    if (manifest) checkAgainstManifest(layout, contents, manifest);
    // Slabs in file order of the tensors, experts in slice order: the order of slab_sha256.
    const expertTensors = new Map(layout.layers.flatMap((l) => l.tensors).map((t) => [t.name, t]));
    let index = 0;
    let bytes = 0;
    for (const { name } of header.tensors) {
      const t = expertTensors.get(name);
      if (!t) continue;
      const manifestTensor = manifest?.layers
        .find((x) => x.layer === t.layer)
        ?.tensors.find((x) => x.name === name);
      const hasher = new SlabHasher(t.slabBytes);
      const start = t.info.absoluteOffset;
      let checked = 0;
      const check = () => {
        for (; checked < hasher.digests.length; checked++, index++) {
          const actual = hasher.digests[checked]!;
          const expert = contents.experts[checked]!;
          const where = {
            layer: t.layer,
            expert,
            tensor: name,
            slab: index,
            offset: (start + BigInt(checked) * t.slabBytes).toString(),
            actual,
          };
          const expected = manifestTensor?.sha256[expert];
          if (expected !== undefined && actual !== expected) {
            throw mismatch(
              `slab of expert ${expert} in ${name} (layer ${t.layer}) does not match the manifest`,
              {
                ...where,
                expected,
                against: "manifest",
              },
            );
          }
          if (actual !== embedded[index]) {
            throw mismatch(
              `slab of expert ${expert} in ${name} (layer ${t.layer}) does not match its ${SLICE_KEYS.slabSha256}`,
              {
                ...where,
                expected: embedded[index],
                against: "slice",
              },
            );
          }
        }
      };
      for await (const chunk of readRanges(
        source,
        [{ start, end: start + t.info.nbytes }],
        chunkSize,
        signal,
      )) {
        hasher.update(chunk);
        bytes += chunk.byteLength;
        check();
      }
    }
    return {
      source: contents.source,
      layers: contents.layers,
      experts: contents.experts,
      slabs: index,
      bytes,
    };
  } finally {
    if (owned) await source.close();
  }
}
