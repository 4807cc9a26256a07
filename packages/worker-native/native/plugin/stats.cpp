// Counters of every MOESWARM backend of the process: splits, bytes, round-trip times per layer,
// the pattern cache, the weights dropped at load, and the native plane's splits and failures.

#include "moeswarm-plugin.h"

#include <stdio.h>
#include <string.h>
#include <time.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <map>
#include <mutex>

struct moeswarm_layer_stats {
    uint64_t count    = 0;
    uint64_t failures = 0;
    uint64_t tokens   = 0;
    double us_total   = 0;
    std::deque<double> samples; // most recent round trips, µs
};

struct moeswarm_stats {
    std::mutex mutex;
    std::map<int, moeswarm_layer_stats> layers;
    uint64_t splits          = 0;
    uint64_t failures        = 0;
    uint64_t bytes_out       = 0;
    uint64_t bytes_in        = 0;
    uint64_t cache_hits      = 0;
    uint64_t cache_misses    = 0;
    uint64_t weights_dropped = 0; // bytes handed to set_tensor and not kept
    uint64_t weights_tensors = 0;
    // the native plane: splits done on a native link, those taken over by the bridge, by code
    uint64_t native_splits    = 0;
    uint64_t native_fallbacks = 0;
    // phase 3: failures after which the alt was asked; hedges sent, and won by the alt
    uint64_t native_failovers  = 0;
    uint64_t native_hedges     = 0;
    uint64_t native_hedge_wins = 0;
    std::map<std::string, uint64_t> native_failures;
    std::deque<double> native_us;       // round trips of native splits, µs
    std::deque<double> native_overhead; // the same less the worker's reported compute, µs
    uint64_t receipts_sent     = 0;
    uint64_t receipts_deferred = 0; // the bridge socket was full: kept for the next ones
};

static moeswarm_stats & moeswarm_get_stats(void) {
    static moeswarm_stats s;
    return s;
}

double moeswarm_now_us(void) {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

// nearest rank
static double moeswarm_percentile(std::vector<double> v, double q) {
    if (v.empty()) {
        return 0;
    }
    std::sort(v.begin(), v.end());
    const double rank = std::ceil(q * (double) v.size());
    const size_t i    = rank < 1 ? 0 : std::min(v.size() - 1, (size_t) rank - 1);
    return v[i];
}

static void moeswarm_stats_native_json(const moeswarm_stats & s, std::string & out) {
    char tmp[384];
    snprintf(tmp, sizeof(tmp),
            "\"native\":{\"splits\":%llu,\"fallbacks\":%llu,\"failovers\":%llu,\"hedges\":%llu,"
            "\"hedgeWins\":%llu,\"roundTripP50Us\":%.1f,\"overheadP50Us\":%.1f,"
            "\"receipts\":%llu,\"receiptsDeferred\":%llu,\"failures\":{",
            (unsigned long long) s.native_splits, (unsigned long long) s.native_fallbacks,
            (unsigned long long) s.native_failovers, (unsigned long long) s.native_hedges,
            (unsigned long long) s.native_hedge_wins,
            moeswarm_percentile(std::vector<double>(s.native_us.begin(), s.native_us.end()), 0.5),
            moeswarm_percentile(std::vector<double>(s.native_overhead.begin(), s.native_overhead.end()), 0.5),
            (unsigned long long) s.receipts_sent, (unsigned long long) s.receipts_deferred);
    out += tmp;
    bool first = true;
    for (const auto & [code, n] : s.native_failures) {
        // codes are ^MOESWARM_[A-Z0-9_]+$ (the decoder checked the worker's): nothing to escape
        out += (first ? "\"" : ",\"") + code + "\":" + std::to_string(n);
        first = false;
    }
    out += "}}";
}

static void moeswarm_push_sample(std::deque<double> & d, double v) {
    d.push_back(v);
    if (d.size() > MOESWARM_SAMPLES_MAX) {
        d.pop_front();
    }
}

void moeswarm_stats_native(bool ok, double us, double worker_ms, const std::string & code) {
    moeswarm_stats & s = moeswarm_get_stats();
    std::lock_guard<std::mutex> lock(s.mutex);
    if (!ok) {
        s.native_fallbacks++;
        s.native_failures[code]++;
        return;
    }
    s.native_splits++;
    moeswarm_push_sample(s.native_us, us);
    if (worker_ms >= 0) {
        moeswarm_push_sample(s.native_overhead, us - worker_ms * 1000.0);
    }
}

void moeswarm_stats_native_failover(const std::string & code) {
    moeswarm_stats & s = moeswarm_get_stats();
    std::lock_guard<std::mutex> lock(s.mutex);
    s.native_failovers++;
    s.native_failures[code]++;
}

void moeswarm_stats_native_hedge(bool won) {
    moeswarm_stats & s = moeswarm_get_stats();
    std::lock_guard<std::mutex> lock(s.mutex);
    s.native_hedges++;
    s.native_hedge_wins += won;
}

void moeswarm_stats_receipts(bool sent) {
    moeswarm_stats & s = moeswarm_get_stats();
    std::lock_guard<std::mutex> lock(s.mutex);
    (sent ? s.receipts_sent : s.receipts_deferred)++;
}

size_t moeswarm_stats_json(char * buf, size_t size) {
    moeswarm_stats & s = moeswarm_get_stats();
    std::lock_guard<std::mutex> lock(s.mutex);
    std::string out = "{\"splits\":" + std::to_string(s.splits) + ",\"failures\":" + std::to_string(s.failures) +
            ",\"bytesOut\":" + std::to_string(s.bytes_out) + ",\"bytesIn\":" + std::to_string(s.bytes_in) +
            ",\"graphCacheHits\":" + std::to_string(s.cache_hits) + ",\"graphCacheMisses\":" + std::to_string(s.cache_misses) +
            ",\"weightsDroppedBytes\":" + std::to_string(s.weights_dropped) +
            ",\"weightsDroppedTensors\":" + std::to_string(s.weights_tensors) + ",\"layers\":{";
    bool first = true;
    for (const auto & [layer, ls] : s.layers) {
        std::vector<double> v(ls.samples.begin(), ls.samples.end());
        char tmp[256];
        snprintf(tmp, sizeof(tmp),
                "%s\"%d\":{\"count\":%llu,\"failures\":%llu,\"tokens\":%llu,\"meanUs\":%.1f,\"p50Us\":%.1f,\"p99Us\":%.1f}",
                first ? "" : ",", layer, (unsigned long long) ls.count, (unsigned long long) ls.failures,
                (unsigned long long) ls.tokens, ls.count ? ls.us_total / ls.count : 0.0, moeswarm_percentile(v, 0.5),
                moeswarm_percentile(v, 0.99));
        out += tmp;
        first = false;
    }
    out += "},";
    moeswarm_stats_native_json(s, out);
    out += "}";
    if (buf != nullptr && size > 0) {
        const size_t n = std::min(out.size(), size - 1);
        memcpy(buf, out.data(), n);
        buf[n] = '\0';
    }
    return out.size();
}

void moeswarm_stats_reset(void) {
    moeswarm_stats & s = moeswarm_get_stats();
    std::lock_guard<std::mutex> lock(s.mutex);
    s.layers.clear();
    s.splits = s.failures = s.bytes_out = s.bytes_in = s.cache_hits = s.cache_misses = 0;
    s.native_splits = s.native_fallbacks = s.receipts_sent = s.receipts_deferred = 0;
    s.native_failovers = s.native_hedges = s.native_hedge_wins = 0;
    s.native_failures.clear();
    s.native_us.clear();
    s.native_overhead.clear();
}

void moeswarm_stats_record(int layer, int64_t n_tokens, double us, bool ok, size_t out, size_t in) {
    moeswarm_stats & s = moeswarm_get_stats();
    std::lock_guard<std::mutex> lock(s.mutex);
    s.splits++;
    s.bytes_out += out;
    s.bytes_in += in;
    moeswarm_layer_stats & ls = s.layers[layer];
    if (!ok) {
        s.failures++;
        ls.failures++;
        return;
    }
    ls.count++;
    ls.tokens += (uint64_t) n_tokens;
    ls.us_total += us;
    ls.samples.push_back(us);
    if (ls.samples.size() > MOESWARM_SAMPLES_MAX) {
        ls.samples.pop_front();
    }
}

void moeswarm_stats_pattern(bool hit) {
    moeswarm_stats & s = moeswarm_get_stats();
    std::lock_guard<std::mutex> lock(s.mutex);
    if (hit) {
        s.cache_hits++;
    } else {
        s.cache_misses++;
    }
}

void moeswarm_stats_weights(size_t bytes, bool new_tensor) {
    moeswarm_stats & s = moeswarm_get_stats();
    std::lock_guard<std::mutex> lock(s.mutex);
    if (new_tensor) {
        s.weights_tensors++;
    }
    s.weights_dropped += bytes;
}
