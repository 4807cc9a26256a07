// The plugin's configuration: MOESWARM_* in the environment, or a JSON file MOESWARM_CONFIG with
// the same keys in camelCase (the environment wins).

#include "moeswarm-plugin.h"

#include <nlohmann/json.hpp>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// "all", "none", "" or a comma list of N and A-B; false on anything else
static bool moeswarm_parse_layers(const std::string & text, moeswarm_config & cfg) {
    cfg.all_layers = false;
    cfg.layers.assign(MOESWARM_MAX_LAYERS, false);
    if (text == "all") {
        cfg.all_layers = true;
        return true;
    }
    if (text.empty() || text == "none") {
        return true;
    }
    size_t i = 0;
    while (i < text.size()) {
        auto read_num = [&](long & out) -> bool {
            size_t j = i;
            while (j < text.size() && text[j] == ' ')
                ++j;
            size_t k = j;
            out      = 0;
            while (k < text.size() && text[k] >= '0' && text[k] <= '9' && k - j < 6) {
                out = out * 10 + (text[k] - '0');
                ++k;
            }
            if (k == j) return false;
            while (k < text.size() && text[k] == ' ')
                ++k;
            i = k;
            return true;
        };
        long a = 0, b = 0;
        if (!read_num(a)) return false;
        b = a;
        if (i < text.size() && text[i] == '-') {
            ++i;
            if (!read_num(b)) return false;
        }
        if (a > b || b >= MOESWARM_MAX_LAYERS) return false;
        for (long l = a; l <= b; ++l)
            cfg.layers[l] = true;
        if (i < text.size()) {
            if (text[i] != ',') return false;
            ++i;
        }
    }
    return true;
}

// the layers of a config file: an array of layer numbers, or a string as MOESWARM_LAYERS takes it
static bool moeswarm_config_layers(const nlohmann::json & v, std::string & layers, std::string & err) {
    if (v.is_string()) {
        layers = v.get<std::string>();
        return true;
    }
    if (!v.is_array()) {
        err = "MOESWARM_CONFIG: layers must be a string or an array";
        return false;
    }
    layers.clear();
    for (const nlohmann::json & e : v) {
        const double d = e.is_number() ? e.get<double>() : -1;
        if (d < 0 || d >= MOESWARM_MAX_LAYERS || d != (long) d) {
            err = "MOESWARM_CONFIG: layers must be layer numbers";
            return false;
        }
        layers += (layers.empty() ? "" : ",") + std::to_string((long) d);
    }
    return true;
}

static bool moeswarm_read_config_file(
        const char * path, moeswarm_config & cfg, std::string & layers, bool & has_layers, std::string & err) {
    FILE * f = fopen(path, "rb");
    if (f == nullptr) {
        err = std::string("cannot open MOESWARM_CONFIG ") + path + ": " + strerror(errno);
        return false;
    }
    std::string text;
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof(buf), f)) > 0 && text.size() < (1u << 20)) {
        text.append(buf, n);
    }
    fclose(f);
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions =*/false);
    if (j.is_discarded()) {
        err = "MOESWARM_CONFIG: malformed JSON";
        return false;
    }
    if (!j.is_object()) {
        err = "MOESWARM_CONFIG must hold a JSON object";
        return false;
    }
    if (j.contains("layers")) {
        has_layers = true;
        if (!moeswarm_config_layers(j["layers"], layers, err)) {
            return false;
        }
    }
    for (const char * key : { "bridge", "model" }) {
        if (!j.contains(key)) {
            continue;
        }
        if (!j[key].is_string()) {
            err = std::string("MOESWARM_CONFIG: ") + key + " must be a string";
            return false;
        }
        (strcmp(key, "bridge") == 0 ? cfg.bridge : cfg.model) = j[key].get<std::string>();
    }
    if (j.contains("timeoutMs")) {
        const double d = j["timeoutMs"].is_number() ? j["timeoutMs"].get<double>() : 0;
        if (d < 1 || d > 86400000) {
            err = "MOESWARM_CONFIG: timeoutMs must be 1..86400000";
            return false;
        }
        cfg.timeout_ms = (int) d;
    }
    return true;
}

moeswarm_config moeswarm_load_config(void) {
    moeswarm_config cfg;
    cfg.layers.assign(MOESWARM_MAX_LAYERS, false);
    std::string layers;
    bool has_layers = false;
    std::string err;
    const char * file = getenv("MOESWARM_CONFIG");
    if (file != nullptr && file[0] != '\0' && !moeswarm_read_config_file(file, cfg, layers, has_layers, err)) {
        GGML_LOG_ERROR("%s: %s; the MOESWARM device claims nothing\n", __func__, err.c_str());
        return moeswarm_config();
    }
    if (const char * v = getenv("MOESWARM_LAYERS")) {
        layers     = v;
        has_layers = true;
    }
    if (const char * v = getenv("MOESWARM_BRIDGE")) {
        cfg.bridge = v;
    }
    if (const char * v = getenv("MOESWARM_MODEL"); v != nullptr && v[0] != '\0') {
        cfg.model = v;
    }
    if (const char * v = getenv("MOESWARM_TIMEOUT_MS"); v != nullptr && v[0] != '\0') {
        const long t = strtol(v, nullptr, 10);
        if (t >= 1 && t <= 86400000) {
            cfg.timeout_ms = (int) t;
        } else {
            GGML_LOG_WARN("%s: MOESWARM_TIMEOUT_MS=%s is not 1..86400000, using %d\n", __func__, v, cfg.timeout_ms);
        }
    }
    // environment only: an operator's switch for one process, not a property of a deployment
    if (const char * v = getenv("MOESWARM_NATIVE"); v != nullptr && (strcmp(v, "0") == 0 || strcmp(v, "false") == 0)) {
        cfg.native = false;
    }
    if (cfg.model.empty() || cfg.model.size() > 256) {
        GGML_LOG_WARN("%s: the model id must be 1..256 bytes, using \"moeswarm\"\n", __func__);
        cfg.model = "moeswarm";
    }
    if (has_layers && !moeswarm_parse_layers(layers, cfg)) {
        GGML_LOG_ERROR("%s: MOESWARM_LAYERS=\"%s\" is not \"all\", \"none\" or a list like 0,1,4-7; the MOESWARM "
                       "device claims nothing\n",
                __func__, layers.c_str());
        cfg.all_layers = false;
        cfg.layers.assign(MOESWARM_MAX_LAYERS, false);
    }
    return cfg;
}

std::string moeswarm_config_fingerprint(void) {
    std::string fp;
    for (const char * name :
            { "MOESWARM_CONFIG", "MOESWARM_LAYERS", "MOESWARM_BRIDGE", "MOESWARM_MODEL", "MOESWARM_TIMEOUT_MS",
                    "MOESWARM_NATIVE" }) {
        const char * v = getenv(name);
        fp += v ? std::string("1") + v : std::string("0");
        fp += '\0';
    }
    return fp;
}

// llama-server's flags as the process got them: /proc/self/cmdline, then LLAMA_ARG_* (the command
// line wins, as in common/arg.cpp). Without a unified KV cache, llama.cpp splits a decode batch
// wherever the busy slots' ids are not consecutive (llama_kv_cache::init_batch ->
// split_equal(sequential = true)), inside the KV cache where no backend can reach it; every piece
// then pays each remote layer's round trip again. llama-server unifies the cache by itself only when
// --parallel is not given (server.cpp: auto -> 4 slots, kv_unified = true).
static bool moeswarm_flag_true(const char * v) {
    return v != nullptr && (strcmp(v, "1") == 0 || strcmp(v, "true") == 0 || strcmp(v, "on") == 0 ||
                                   strcmp(v, "enabled") == 0);
}

void moeswarm_warn_split_batches(void) {
    FILE * f = fopen("/proc/self/cmdline", "rb");
    if (f == nullptr) {
        return;
    }
    std::vector<std::string> args;
    std::string cur;
    for (int c; (c = fgetc(f)) != EOF;) {
        if (c == '\0') {
            args.push_back(cur);
            cur.clear();
        } else {
            cur += (char) c;
        }
    }
    fclose(f);
    if (args.empty() || args[0].find("llama-server") == std::string::npos) {
        return; // node-llama-cpp and the harness decode in fixed batches of their own
    }
    long parallel     = -1;
    bool kv_unified   = false;
    bool parallel_set = false;
    if (const char * v = getenv("LLAMA_ARG_N_PARALLEL")) {
        parallel     = strtol(v, nullptr, 10);
        parallel_set = true;
    }
    kv_unified = moeswarm_flag_true(getenv("LLAMA_ARG_KV_UNIFIED"));
    for (size_t i = 1; i < args.size(); ++i) {
        const std::string & a = args[i];
        if ((a == "-np" || a == "--parallel") && i + 1 < args.size()) {
            parallel     = strtol(args[i + 1].c_str(), nullptr, 10);
            parallel_set = true;
        } else if (a == "-kvu" || a == "--kv-unified") {
            kv_unified = true;
        } else if (a == "-no-kvu" || a == "--no-kv-unified") {
            kv_unified = false;
        }
    }
    if (parallel_set && parallel != -1 && parallel > 1 && !kv_unified) {
        GGML_LOG_WARN("moeswarm: llama-server --parallel %ld without -kvu: llama.cpp then splits each decode step "
                      "wherever the busy slots are not consecutive, and every piece pays each remote layer's round "
                      "trip again (up to %ld times per step). Add -kvu (--kv-unified), as moeswarm-dispatcher "
                      "prints it.\n",
                parallel, parallel);
    }
}
