#pragma once

// ggml-moeswarm: a ggml backend (API version 2) that hands the routed-expert FFN of chosen MoE
// layers of an unmodified llama.cpp to moeswarm's dispatcher bridge.
//
// Loaded with GGML_BACKEND_PATH=/path/libggml-moeswarm.so into a process that already holds
// libggml-base (node-llama-cpp's addon, llama-server, the logits harness).
//
// - Device "MOESWARM", type ACCEL: no layers, no KV cache, one backend in every context.
// - Buffer type "MOESWARM": routed-expert weights are recorded and dropped at set_tensor (the
//   workers hold them); the address range is reserved without RAM. Compute buffers (the split's
//   inputs and output) are ordinary memory.
// - supports_op is structural, so that each remote MoE layer is exactly one split per ubatch:
//   gate/up MUL_MAT_ID -> activation -> down MUL_MAT_ID -> weighting MUL -> adds of the k views
//   (llama4: no weighting MUL; llama.cpp weighted the k input rows before the split).
// - graph_compute sends one `dispatch` frame (mode "sum") per split over a Unix or TCP socket and
//   blocks until the combined `result`; an `error` frame or a dead socket fails the compute
//   (llama_decode returns an error), never a wrong value.
// - The native data plane (issue #15; docs/protocol.md section 10.9 and the plugin socket's frames):
//   each backend connects to the bridge when it is created and says `native-hello`; the bridge
//   pushes `native-table`s (per layer: the one worker that holds all its experts, its native
//   listener's host:port, certificate fingerprint and a direct-link ticket; deadlineMs), read at
//   the start of every split and while a split waits for the bridge. A layer in the table goes
//   straight to that worker over TLS (OpenSSL 3 found at run time, common/moeswarm-tls.h; pinned;
//   hello with the ticket), the same dispatch frame. Any failure there (no link, pin mismatch,
//   refused hello, error frame, deadlineMs, wrong shape, a non-finite value) sends that split
//   through the bridge, which computes the same bits, and backs the worker off (1 s doubling to
//   60 s). A layer split over several workers (phase 2) has one entry per worker, each with its
//   `experts` range [lo, hi) (disjoint, or the whole table is refused): each owner with a filled
//   slot gets one dispatch in mode "each" (compact) with the rows of the tokens that have a slot of
//   its own and the other owners' ids masked to -1, all sent before any answer is read; the plugin
//   combines the answers with the compute core's moeswarm_combine_sum (llama.cpp's mul and add
//   nodes, bit for bit). An id no range holds: the bridge. Phase 3: an entry may name an `alt` (a
//   replica of its range, or of the whole layer), and each entry is raced on its own (a whole-layer
//   entry's frame, or one owner's dispatch): its worker's failure (its or its link's fault) sends
//   the same dispatch to the alt natively first, and a worker silent past its hedge moment (the
//   table's `hedgeMs`, or `hedgeFactor` x its recent p50) races the alt (first valid answer wins;
//   the loser is not backed off and its late answer is skipped by id on the link's next use); the
//   other owners are not touched. An entry nobody could answer: the links still owing an answer
//   closed, that worker backed off, the whole split through the bridge. `native-receipts` (splits,
//   tokens and expert-tokens per worker and layer, failures with their codes) go to the bridge at
//   most once a second and when the backend is freed, never
//   waiting on the socket. An empty table, no OpenSSL, or MOESWARM_NATIVE=0: the bridge only.
//
// Configuration (environment, or a JSON file MOESWARM_CONFIG with the same keys in camelCase:
// {"layers": "0,1", "bridge": "unix:/tmp/b.sock", "model": "m", "timeoutMs": 60000}; the
// environment wins):
//   MOESWARM_LAYERS      "all", "none" or "0,1,4-7": layers whose expert tensors the device claims
//                        in llama.cpp's load-time buffer-type probe (node-llama-cpp has no -ot).
//                        With llama-server's -ot '...=MOESWARM' this is not needed.
//   MOESWARM_BRIDGE      unix:/path/to/socket | tcp:host:port
//   MOESWARM_MODEL       model id in the dispatch frames (default "moeswarm")
//   MOESWARM_TIMEOUT_MS  how long one split may wait for its result (default 30000); a broken
//                        connection is reopened and the split sent again once within it
//   MOESWARM_CLAIM_FILE  optional, environment only: a line is appended to this file for every
//                        weight buffer the device allocates (proof of a claim for the host)
//   MOESWARM_NATIVE      environment only: 0 (or false) sends no native-hello, so every split
//                        goes through the bridge
// They are read again whenever they change: a backend (one per llama context) keeps the values
// of its creation, the load-time probe uses the current ones.
//
// The stats JSON (ggml_backend_moeswarm_stats) has "native": {splits, fallbacks (native splits the
// bridge took over), failovers (failures after which the alt was asked), hedges, hedgeWins, roundTripP50Us, overheadP50Us (round trip less the worker's reported ms),
// receipts, receiptsDeferred (the socket was full: kept for the next), failures: {code: count}}.
//
// The plugin's files: config.cpp (MOESWARM_* and MOESWARM_CONFIG), stats.cpp (counters of all
// backends), transport.cpp (the socket to the bridge), buffer.cpp (the MOESWARM buffer type),
// pattern.cpp (what the device computes: supports_op and the split's tensors), round-trip.cpp (the
// dispatch frame, the one writer of a result into the split's output, the bridge round trip),
// native-table.cpp (native-hello, native-table, native-receipts on the bridge socket),
// native-link.cpp (a native link over TLS), native-race.cpp (a split's parts racing their entry's
// worker and alt: failover and hedge), native-replica.cpp (a whole-layer split: one part),
// native-split.cpp (a split over several workers: one part per owner),
// backend.cpp (the backend, device and registry that ggml sees). This header is what they share.

#include "ggml-backend-impl.h"
#include "ggml-backend.h"
#include "ggml-impl.h"
#include "ggml.h"
#include "moeswarm-frame.h"
#include "moeswarm-msgpack.h"
#include "moeswarm-native-open.h"
#include "moeswarm-tls.h"

#include <stddef.h>
#include <stdint.h>

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <functional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#define MOESWARM_NAME            "MOESWARM"
#define MOESWARM_MAX_LAYERS      4096
#define MOESWARM_ALIGNMENT       64
#define MOESWARM_ROLE_MAX_DEPTH  1024
#define MOESWARM_CACHE_MAX       512
#define MOESWARM_SAMPLES_MAX     8192
// a stopped dispatcher blocks every sequence of a llama-server for this long: 30 s is longer than
// any healthy split (the bridge falls back or fails a call well before) and short enough to notice
#define MOESWARM_TIMEOUT_DEFAULT 30000

//
// configuration (config.cpp)
//

struct moeswarm_config {
    std::vector<bool> layers; // claimed in the load-time probe
    bool all_layers = false;
    std::string bridge;
    std::string model = "moeswarm";
    int timeout_ms    = MOESWARM_TIMEOUT_DEFAULT;
    bool native       = true; // MOESWARM_NATIVE (environment only): 0 keeps every split on the bridge
};

// the configuration the environment (and MOESWARM_CONFIG) gives now; errors are logged and
// leave a configuration that claims nothing
moeswarm_config moeswarm_load_config(void);
// changes whenever an environment variable that makes the configuration changes
std::string moeswarm_config_fingerprint(void);
// a warning when the host is llama-server with --parallel N > 1 and no -kvu (config.cpp)
void moeswarm_warn_split_batches(void);
// the device's current configuration (re-read when the fingerprint changes; backend.cpp)
std::shared_ptr<const moeswarm_config> moeswarm_config_current(void);

//
// tensor names (pattern.cpp)
//

// blk.N.ffn_{gate,up,down,gate_up}_exps.{weight,bias,scale}: which layer and projection; false
// for any other tensor
enum moeswarm_proj { MOESWARM_PROJ_GATE, MOESWARM_PROJ_UP, MOESWARM_PROJ_DOWN, MOESWARM_PROJ_GATE_UP };
bool moeswarm_expert_name(const char * name, int * layer, moeswarm_proj * proj);

//
// statistics (stats.cpp): all backends of the process
//

double moeswarm_now_us(void);
// JSON of the counters; what the logits harness prints and a host can read through the
// registry's proc address "ggml_backend_moeswarm_stats"
size_t moeswarm_stats_json(char * buf, size_t size);
void moeswarm_stats_reset(void);
// one split's round trip (us: its duration; out, in: bytes on the wire)
void moeswarm_stats_record(int layer, int64_t n_tokens, double us, bool ok, size_t out, size_t in);
// a native split: done (ok, its round trip and the worker's compute ms, < 0 when not reported),
// or failed with code and taken over by the bridge (a fallback)
void moeswarm_stats_native(bool ok, double us, double worker_ms, const std::string & code);
// a failure after which the split stayed native (the alt asked: failover), counted with its code
void moeswarm_stats_native_failover(const std::string & code);
// a hedge sent to an alt; won: the alt's answer came first
void moeswarm_stats_native_hedge(bool won);
// native-receipts written (sent) or kept for later (the socket was full)
void moeswarm_stats_receipts(bool sent);
// a split's pattern found in the backend's cache (hit) or searched (miss)
void moeswarm_stats_pattern(bool hit);
// bytes of weights handed to set_tensor and dropped; new_tensor: the first chunk of a tensor
void moeswarm_stats_weights(size_t bytes, bool new_tensor);

//
// the bridge connection (transport.cpp)
//

struct moeswarm_conn {
    int fd           = -1;
    uint32_t next_id = 1;
    std::vector<uint8_t> rx;
    // bytes read ahead of what was asked (a drain of what the bridge pushed reads whatever is there)
    std::vector<uint8_t> in;
    size_t in_pos = 0;
    // the tail of a frame that a non-blocking write could not finish; written before anything else
    std::vector<uint8_t> out_pending;
};

void moeswarm_conn_close(moeswarm_conn & c);
// whatever the socket holds now, appended to c.in without waiting; false when the bridge closed
bool moeswarm_conn_fill(moeswarm_conn & c, std::string & err);
// a whole frame without waiting: false when the socket cannot take a byte now (nothing written);
// a partial write keeps its tail in c.out_pending, written before the next frame
bool moeswarm_send_nowait(moeswarm_conn & c, const uint8_t * data, size_t size);
// connects to MOESWARM_BRIDGE: unix:/path or tcp:host:port
bool moeswarm_conn_open(moeswarm_conn & c, const std::string & bridge, std::string & err);
// the whole buffer, or an error (a dead peer, or deadline_us of moeswarm_now_us passed)
bool moeswarm_send_all(moeswarm_conn & c, const uint8_t * data, size_t size, double deadline_us, std::string & err);
bool moeswarm_recv_all(moeswarm_conn & c, uint8_t * data, size_t size, double deadline_us, std::string & err);

//
// the buffer type (buffer.cpp) and the device (backend.cpp): one each, for the process
//

ggml_backend_buffer_type_t moeswarm_buft(void);
ggml_backend_dev_t moeswarm_device(void);
bool moeswarm_buffer_is_weights(ggml_backend_buffer_t buffer);

//
// what the device computes (pattern.cpp)
//

// whether the device takes this node (ggml_backend_dev_supports_op)
bool moeswarm_supports_op(const ggml_tensor * op);

// what one split is: found once per split (graph uid), then only read
struct moeswarm_pattern {
    int layer         = -1;
    ggml_tensor * x   = nullptr; // [n_embd, 1, n_tokens] f32: the normed hidden rows
    ggml_tensor * ids = nullptr; // [k, n_tokens] i32, strided (a view of the argsort)
    ggml_tensor * w   = nullptr; // [1, k, n_tokens] f32: the router weights (null when weighted_input)
    // llama4 (build_moe_ffn's weight_before_ffn): the backbone multiplied the input by the router
    // weights before the split (ffn_moe_weighted), so x is [n_embd, k, n_tokens], one weighted row
    // per slot, and the split sums the k expert outputs unweighted
    bool weighted_input = false;
    ggml_tensor * out = nullptr; // [n_embd, n_tokens] f32: ffn_moe_out
    int64_t n_embd    = 0;
    int64_t n_tokens  = 0;
    int64_t k         = 0;
};

// the tensors of one split (the routed-expert FFN of one layer); false with err otherwise
bool moeswarm_find_pattern(const ggml_cgraph * cgraph, moeswarm_pattern & p, std::string & err);

//
// the native data plane (native-table.cpp, native-link.cpp; docs/protocol.md sections 10.9 and B)
//

// a worker of the bridge's native-table, where and how to reach it
struct moeswarm_native_target {
    std::string worker;
    std::string addr;   // host:port or [v6]:port of its native listener
    std::string fp;     // its certificate's SHA-256, pinned
    std::string ticket; // mswt1... for the hello
    uint64_t exp_ms = 0; // the ticket's expiry, unix ms
};

// one entry of the bridge's native-table: a worker that serves a layer's experts (all of them, or
// the range lo..hi-1), and maybe a replica of them (phase 3: failover and hedge)
struct moeswarm_native_entry : moeswarm_native_target {
    int64_t lo = -1, hi = -1; // `experts` [lo, hi); -1: no range, the whole layer (the only entry)
    bool has_alt = false;     // `alt`: another worker holding the whole range, primary of no range
    moeswarm_native_target alt;
};

struct moeswarm_native_table {
    uint64_t seq = 0;
    std::string backbone; // the hello's id
    uint32_t deadline_ms = 0;
    uint32_t hedge_ms    = 0; // `hedgeMs`: a primary silent this long races its alt; 0: no hedge
    // `hedgeAdaptive` (dispatch's adaptive hedge, the bridge's default): a primary silent for
    // max(hedge_min_ms, hedge_factor x its recent round trips' p50) races its alt; 0: off. A primary
    // without MOESWARM_NATIVE_RT_MIN round trips of history is not hedged (as dispatch's liveness).
    double   hedge_factor = 0;
    uint32_t hedge_min_ms = 0;
    // per layer: one entry without a range (one worker holds every expert: a mode-sum dispatch), or
    // entries with disjoint ranges (a split over several workers: native-split.cpp)
    std::unordered_map<int, std::vector<moeswarm_native_entry>> layers;
};

// this backend's link to one worker
#define MOESWARM_NATIVE_RT_RING 32
#define MOESWARM_NATIVE_RT_MIN 4

struct moeswarm_native_peer {
    moeswarm_tls_conn conn;
    std::string addr, fp; // of the open connection
    uint32_t next_id = 1;
    double backoff_ms = 0;  // 0: healthy; else 1 s doubling to 60 s after each failure
    double retry_at_us = 0; // no native split to this worker before this moment
    std::vector<uint8_t> rx;
    // the largest result asked for on this link: a hedge's loser answers late, and its (maybe
    // larger, a prompt's) result must be read and skipped, not taken for an oversized frame
    size_t max_result = 0;
    // the latest un-hedged round trips it answered, µs, for the adaptive hedge (a ring)
    float rt_us[MOESWARM_NATIVE_RT_RING] = {};
    uint32_t rt_n = 0, rt_at = 0;
};

// a native split answered: its filled ids into nv.routed
struct moeswarm_native;
void moeswarm_native_note_routed(moeswarm_native & nv, int layer, const std::vector<int32_t> & ids);

// the adaptive hedge's delay for a primary, µs, or 0 (no hedge: none set, or too little history)
double moeswarm_native_hedge_delay_us(const moeswarm_native_table & t, const moeswarm_native_peer & pr);
// one more answered round trip of pr (the ring keeps the latest MOESWARM_NATIVE_RT_RING)
void moeswarm_native_note_rt(moeswarm_native_peer & pr, double rt_us);

struct moeswarm_native_count {
    uint64_t splits = 0, tokens = 0, expert_tokens = 0;
};

struct moeswarm_native_failure {
    std::string worker, code, msg;
    bool failover = false; // the split stayed native after it: the alt was asked (or racing)
};

struct moeswarm_native {
    bool on = false;         // native-hello sent on the current bridge connection
    bool table_seen = false; // a native-table came on it
    moeswarm_native_table table;
    std::unordered_map<std::string, moeswarm_native_peer> peers;
    // since the last native-receipts: per (worker, layer), and the failures
    std::map<std::pair<std::string, int>, moeswarm_native_count> counts;
    // per split layer (several owners): its native splits and their tokens, counted once per split
    // (the owners' counts have their own tokens each); `layers` of native-receipts
    std::map<int, moeswarm_native_count> split_layers;
    // per layer, per expert id: the filled slots of its native splits that chose it (the router's
    // choices, which the bridge counts of its own requests for the hub); `routing` of native-receipts
    std::map<int, std::map<int32_t, uint64_t>> routed;
    std::vector<moeswarm_native_failure> failures;
    uint64_t hedges = 0, hedge_wins = 0; // since the last native-receipts
    uint64_t receipts_seq  = 0;
    double last_receipt_us = 0;
};

//
// a backend: one per llama context, with its own bridge connection and native links
//

struct moeswarm_backend_context {
    std::mutex mutex;
    std::shared_ptr<const moeswarm_config> config; // as it was when the backend was created
    moeswarm_conn conn;
    std::unordered_map<uint64_t, moeswarm_pattern> cache;
    std::deque<uint64_t> cache_order;
    // the split's inputs, gathered: x [n_rows, n_embd], ids and w [n_tokens, k]
    std::vector<float> x;
    std::vector<int32_t> ids;
    std::vector<float> w;
    moeswarm_mp_writer tx;
    moeswarm_native native;
    // a split over several workers (native-split.cpp): one owner's rows, ids; every slot's answer
    std::vector<float> sub_x;
    std::vector<int32_t> sub_ids;
    std::vector<float> y_slots;
    std::vector<int32_t> slot_row;
    std::vector<float> y_sum;
};

// the request id to use now, next advanced (wrapping past 0, which is never an id)
uint32_t moeswarm_next_id(uint32_t & next);
// d as one section-7 frame in tx (length prefix included), tx's old bytes dropped
void moeswarm_write_prefixed_dispatch(moeswarm_mp_writer & tx, const moeswarm_dispatch_desc & d);
// the split (round-trip.cpp): the dispatch frame (mode sum, length prefix included) into ctx->tx
void moeswarm_build_dispatch(moeswarm_backend_context * ctx, const moeswarm_config & cfg, const moeswarm_pattern & p,
        uint32_t id);
// a result for that dispatch: its shape, and (check_finite) every value finite
bool moeswarm_check_result(const moeswarm_frame & f, const moeswarm_pattern & p, bool check_finite, std::string & err);
// whether the n f32 values at y (any alignment) are all finite; err names the first that is not
bool moeswarm_all_finite(const uint8_t * y, size_t n, std::string & err);
// the result's y into the split's out tensor: the one writer of both paths
void moeswarm_write_out(const uint8_t * y, const moeswarm_pattern & p);
// today's path: the split through the bridge (one more try on a fresh connection when a reused
// one turns out dead), within MOESWARM_TIMEOUT_MS
bool moeswarm_bridge_split(moeswarm_backend_context * ctx, const moeswarm_config & cfg, const moeswarm_pattern & p,
        std::string & err, size_t & bytes_out, size_t & bytes_in);

// the bridge side (native-table.cpp)
// after the bridge connection opened: a fresh table, and native-hello unless MOESWARM_NATIVE=0 or
// there is no TLS
void moeswarm_native_on_connect(moeswarm_backend_context * ctx, const moeswarm_config & cfg);
// a frame the bridge sent: true when it was one of the native plane's (applied, or ignored)
bool moeswarm_native_on_frame(moeswarm_backend_context * ctx, const uint8_t * payload, size_t size);
// what the bridge pushed since the last look, without waiting (start of every split)
void moeswarm_native_drain(moeswarm_backend_context * ctx);
// native-receipts when a second has passed since the last ones (or force: the backend is freed);
// never waits: a socket that cannot take them now keeps them for the next time
void moeswarm_native_receipts(moeswarm_backend_context * ctx, bool force);

// the worker side (native-link.cpp)
enum moeswarm_native_outcome { MOESWARM_NATIVE_SKIP, MOESWARM_NATIVE_OK, MOESWARM_NATIVE_FAILED };
// the split straight to the worker of its layer's table entry (spec C); FAILED: reported, backed
// off, and the caller takes the bridge path
moeswarm_native_outcome moeswarm_native_split(moeswarm_backend_context * ctx, const moeswarm_config & cfg,
        const moeswarm_pattern & p, size_t & bytes_out, size_t & bytes_in);
// closes every native link (the backend is freed, or the table changed)
void moeswarm_native_close_all(moeswarm_native & nv);

// what native-link.cpp shares with native-split.cpp (and moeswarm-native-open.h's errors)
double moeswarm_wall_ms(void);
// The frame `build` writes into ctx->tx, sent on pr's link to t (opened when needed). A reused link
// found closed (the worker closed it idle, or restarted) is opened again and the frame rebuilt and
// sent once (retried). reused: whether the last try went on a link that was already open.
bool moeswarm_native_send(moeswarm_backend_context * ctx, moeswarm_native_peer & pr, const moeswarm_native_target & t,
        const std::function<void()> & build, int layer, double deadline, bool & reused, bool & retried,
        moeswarm_native_err & ne, size_t & bytes_out);
// pr's link to e opened (moeswarm_native_dial, moeswarm_native_hello with e's ticket), its ids restarted
bool moeswarm_native_connect(moeswarm_native_peer & pr, const moeswarm_native_table & t, const moeswarm_native_target & e,
        double deadline, moeswarm_native_err & ne);
// the worker's `ms` (compute time) of a result, or -1
double moeswarm_native_result_ms(const uint8_t * data, size_t size);
// one frame from the worker (waiting until deadline): RESULT with f decoded when it is request id's
// result; SKIPPED for a pong or a late answer to another id (a split given up on, a hedge's loser);
// FAILED with ne for an error frame of id (or without one), a drain, a bad frame, the link or the deadline
enum moeswarm_native_read { MOESWARM_NATIVE_READ_RESULT, MOESWARM_NATIVE_READ_SKIPPED, MOESWARM_NATIVE_READ_FAILED };
moeswarm_native_read moeswarm_native_read_one(moeswarm_native_peer & pr, uint64_t id, size_t max_frame, double deadline,
        const std::string & who, int layer, moeswarm_frame & f, moeswarm_native_err & ne, size_t & bytes_in);
// a failure: the link closed, the worker backed off, the failure kept for the receipts (failover:
// the split stays native, asked of the entry's alt)
void moeswarm_native_failed(moeswarm_native & nv, moeswarm_native_peer & pr, const std::string & worker,
        const moeswarm_pattern & p, const moeswarm_native_err & ne, bool failover = false);
// the split over the several workers of a layer's ranged entries (native-split.cpp)
moeswarm_native_outcome moeswarm_native_split_ranges(moeswarm_backend_context * ctx, const moeswarm_config & cfg,
        const moeswarm_pattern & p, const std::vector<moeswarm_native_entry> & entries, size_t & bytes_out,
        size_t & bytes_in);

// the race of a native split's parts (native-race.cpp): a whole-layer split is one part, a split
// over several owners one part per owner; each part asks its entry's worker and maybe its alt

// one worker asked for a part: the entry's own, or its alt
struct moeswarm_native_try {
    const moeswarm_native_target * t = nullptr;
    moeswarm_native_peer * pr        = nullptr;
    uint32_t id                      = 0;
    bool reused = false, retried = false, sent = false, failed = false;
    int fail_order = -1; // when both failed: the later one is the part's last
    moeswarm_native_err ne;
    double ms = -1; // the worker's reported compute time of the answer used
};

struct moeswarm_native_part {
    moeswarm_native_try at[2];
    int n           = 0;  // at[0] is asked first; at[1], when set, is the spare (failover or hedge)
    int winner      = -1; // whose answer was used
    int failures    = 0;
    bool hedged     = false;
    double hedge_at = 0; // moeswarm_now_us when the spare races at[0]; 0: no hedge
    size_t max_result = 0; // the largest result frame its dispatch may get
    // its dispatch, with this request id, into ctx->tx (length prefix included)
    std::function<void(uint32_t id)> build;
    // a result frame for it: checked, then written where the split takes it from; false with err
    std::function<bool(const moeswarm_frame & f, std::string & err)> take;
};

// when a native split begun at t0 gives up: the table's deadline, within the plugin's own timeout
double moeswarm_native_deadline(const moeswarm_native & nv, const moeswarm_config & cfg, double t0);
// who part asks for entry e: its worker when it may be asked now (not backing off, and a live
// ticket when a link must be opened), and its alt (the spare, or alone when the worker may not be
// asked); the hedge moment from t0 when both are there. false: nobody may be asked
bool moeswarm_native_part_init(moeswarm_native & nv, moeswarm_native_part & part, const moeswarm_native_entry & e,
        double t0);
// every part's dispatch sent, then answers read from all the parts' workers at once until each part
// has a valid one (true); spares go out as failover or hedge. false: parts[lost] has nobody left to
// wait on (or the deadline passed first: the first part unanswered), and the split fails; the links
// still owing an answer are closed then (the failed workers' are closed as they are backed off:
// moeswarm_native_race_settle)
bool moeswarm_native_race_run(moeswarm_backend_context * ctx, const moeswarm_pattern & p, moeswarm_native_part * parts,
        size_t n, double t0, double deadline, size_t & lost, size_t & bytes_out, size_t & bytes_in);
// a part's failures backed off and reported (a failover when the part stayed native after it; the
// lost part's last failure: last_code, the split's fallback), its hedge counted
void moeswarm_native_race_settle(moeswarm_native & nv, const moeswarm_pattern & p, moeswarm_native_part & part,
        bool lost, std::string & last_code);
// the winner of part credited with a split of layer, its tokens and filled ids; its backoff reset
void moeswarm_native_credit(moeswarm_native & nv, const moeswarm_native_part & part, int layer, uint64_t tokens,
        uint64_t filled);
