// Counters of every MOESWARM backend of the process: splits, bytes, round-trip times per layer,
// the pattern cache and the weights dropped at load.

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
    out += "}}";
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
