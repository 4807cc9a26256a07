// Test-time oracle for the offload planner: asks llama.cpp itself (node-llama-cpp 3.21.1's
// prebuilt libllama, the pinned release) what a plan costs, without allocating it.
//
//   llama-probe regex <pattern>            names on stdin, one a line -> the names std::regex_search
//                                          matches, as llama_model_loader does for -ot patterns
//   llama-probe memory <model.gguf> [options] -> JSON: the memory breakdown per buffer type
//                                          (model / context / compute bytes) of a no_alloc load
//                                          and context, and the tensors llama.cpp moved for -ot
//
// memory options: --libdir D --ctx N --batch N --ubatch N --seqs N --type-k T --type-v T
//                 --fa 0|1 --ngl N --ot "<pattern>=<buffer type>,..." (as llama-server's -ot)
#include "llama.h"
#include "llama-ext.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <list>
#include <map>
#include <regex>
#include <string>
#include <vector>

static std::vector<std::string> g_overridden;
static std::vector<std::string> g_log;

static void on_log(enum ggml_log_level level, const char * text, void *) {
    static std::string line;
    line += text;
    if (line.empty() || line.back() != '\n') {
        return;
    }
    // llama-model-loader.cpp: "tensor %s (%zu MiB %s) buffer type overridden to %s"
    static const std::string key = "buffer type overridden to";
    if (line.find(key) != std::string::npos) {
        const size_t a = line.find("tensor ");
        const size_t b = line.find(' ', a + 7);
        if (a != std::string::npos && b != std::string::npos) {
            g_overridden.push_back(line.substr(a + 7, b - a - 7));
        }
    }
    if (level >= GGML_LOG_LEVEL_WARN || line.find("failed") != std::string::npos) {
        g_log.push_back(line);
    }
    line.clear();
}

static std::string json_escape(const std::string & s) {
    std::string out;
    for (char c : s) {
        if (c == '"' || c == '\\') {
            out += '\\';
            out += c;
        } else if ((unsigned char) c < 0x20) {
            char buf[8];
            snprintf(buf, sizeof(buf), "\\u%04x", c);
            out += buf;
        } else {
            out += c;
        }
    }
    return out;
}

static ggml_type cache_type(const std::string & name) {
    static const ggml_type types[] = {
        GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0,
        GGML_TYPE_Q4_1, GGML_TYPE_IQ4_NL, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1,
    };
    for (ggml_type t : types) {
        if (name == ggml_type_name(t)) {
            return t;
        }
    }
    fprintf(stderr, "unknown cache type %s\n", name.c_str());
    exit(2);
}

static int cmd_regex(const char * pattern) {
    // As llama_model_loader::create_tensor: std::regex with default (ECMAScript) flags, regex_search.
    const std::regex re(pattern);
    std::string name;
    while (std::getline(std::cin, name)) {
        if (std::regex_search(name, re)) {
            std::cout << name << '\n';
        }
    }
    return 0;
}

static int cmd_memory(int argc, char ** argv) {
    std::string model_path = argv[2];
    std::string libdir;
    std::string ot;
    uint32_t n_ctx = 4096, n_batch = 2048, n_ubatch = 512, n_seqs = 1;
    int ngl = 999, fa = 1;
    std::string type_k = "f16", type_v = "f16";
    for (int i = 3; i + 1 < argc; i += 2) {
        const std::string a = argv[i];
        const char * v = argv[i + 1];
        if (a == "--libdir") libdir = v;
        else if (a == "--ctx") n_ctx = (uint32_t) atoi(v);
        else if (a == "--batch") n_batch = (uint32_t) atoi(v);
        else if (a == "--ubatch") n_ubatch = (uint32_t) atoi(v);
        else if (a == "--seqs") n_seqs = (uint32_t) atoi(v);
        else if (a == "--type-k") type_k = v;
        else if (a == "--type-v") type_v = v;
        else if (a == "--fa") fa = atoi(v);
        else if (a == "--ngl") ngl = atoi(v);
        else if (a == "--ot") ot = v;
        else {
            fprintf(stderr, "unknown option %s\n", a.c_str());
            return 2;
        }
    }
    llama_log_set(on_log, nullptr);
    if (!libdir.empty()) {
        ggml_backend_load_all_from_path(libdir.c_str());
    } else {
        ggml_backend_load_all();
    }

    // common/arg.cpp parse_tensor_buffer_overrides: split on ',', pattern before the first '=',
    // the buffer type by the name of a device's default buffer type.
    std::map<std::string, ggml_backend_buffer_type_t> bufts;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(ggml_backend_dev_get(i));
        if (buft) {
            bufts[ggml_backend_buft_name(buft)] = buft;
        }
    }
    std::list<std::string> patterns;
    std::vector<llama_model_tensor_buft_override> overrides;
    size_t start = 0;
    while (!ot.empty() && start <= ot.size()) {
        size_t end = ot.find(',', start);
        if (end == std::string::npos) end = ot.size();
        const std::string item = ot.substr(start, end - start);
        const size_t eq = item.find('=');
        if (eq == std::string::npos || bufts.find(item.substr(eq + 1)) == bufts.end()) {
            fprintf(stderr, "bad override %s\n", item.c_str());
            return 2;
        }
        patterns.push_back(item.substr(0, eq));
        overrides.push_back({ patterns.back().c_str(), bufts.at(item.substr(eq + 1)) });
        start = end + 1;
    }
    overrides.push_back({ nullptr, nullptr });

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = ngl;
    mp.no_alloc = true;
    mp.load_mode = LLAMA_LOAD_MODE_NONE;
    mp.tensor_buft_overrides = overrides.size() > 1 ? overrides.data() : nullptr;
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mp);
    if (!model) {
        fprintf(stderr, "failed to load %s\n", model_path.c_str());
        for (const auto & l : g_log) fprintf(stderr, "%s", l.c_str());
        return 1;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_ctx;
    cp.n_batch = n_batch;
    cp.n_ubatch = n_ubatch;
    cp.n_seq_max = n_seqs;
    cp.type_k = cache_type(type_k);
    cp.type_v = cache_type(type_v);
    cp.flash_attn_type = fa ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "failed to create a context\n");
        for (const auto & l : g_log) fprintf(stderr, "%s", l.c_str());
        llama_model_free(model);
        return 1;
    }
    const llama_memory_breakdown mb = llama_get_memory_breakdown(ctx);
    printf("{\"n_ctx\":%u,\"n_ctx_seq\":%u,\"n_batch\":%u,\"n_ubatch\":%u,\"buffers\":[", llama_n_ctx(ctx),
           llama_n_ctx_seq(ctx), llama_n_batch(ctx), llama_n_ubatch(ctx));
    bool first = true;
    for (const auto & [buft, d] : mb) {
        printf("%s{\"name\":\"%s\",\"host\":%s,\"model\":%zu,\"context\":%zu,\"compute\":%zu}", first ? "" : ",",
               json_escape(ggml_backend_buft_name(buft)).c_str(), ggml_backend_buft_is_host(buft) ? "true" : "false",
               d.model, d.context, d.compute);
        first = false;
    }
    printf("],\"overridden\":[");
    for (size_t i = 0; i < g_overridden.size(); ++i) {
        printf("%s\"%s\"", i ? "," : "", json_escape(g_overridden[i]).c_str());
    }
    printf("]}\n");
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}

int main(int argc, char ** argv) {
    if (argc >= 3 && strcmp(argv[1], "regex") == 0) {
        return cmd_regex(argv[2]);
    }
    if (argc >= 3 && strcmp(argv[1], "memory") == 0) {
        return cmd_memory(argc, argv);
    }
    fprintf(stderr, "usage: llama-probe regex <pattern> | memory <model.gguf> [options]\n");
    return 2;
}
