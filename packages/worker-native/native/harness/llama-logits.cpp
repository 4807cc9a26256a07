// llama-logits: greedy decoding with the libllama that node-llama-cpp ships, printing what the
// equivalence tests compare: the tokens, and (--logits) the raw f32 logits of every step.
//
//   llama-logits --model m.gguf --prompt "text" --n-predict 64 --logits out.bin
//                [--ot 'blk\.(0|1)\.ffn_.*_exps.*=MOESWARM'] [--no-mmap] [--ctx 512] [--batch 512]
//                [--ubatch 512] [--threads 2] [--bins <dir>]
//
// The backends come from ggml_backend_load_all_from_path(<bins>) (default: the directory libllama
// was loaded from), which also loads GGML_BACKEND_PATH: that is how the moeswarm plugin gets in.
// The prompt is decoded as one batch, then N tokens one at a time, each the argmax of the last
// logits (ties to the lower id). stdout: one JSON object. Exit status: 0, or 1 with a message on
// stderr (a failed llama_decode among them).

#include "ggml-backend.h"
#include "llama.h"

#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <list>
#include <map>
#include <string>
#include <vector>

static const char * k_usage =
    "usage: llama-logits --model <gguf> [--prompt <text>] [--n-predict <n>] [--logits <out.bin>]\n"
    "                    [--ot <regex>=<buffer type>[,...]] [--no-mmap] [--ctx <n>] [--batch <n>]\n"
    "                    [--ubatch <n>] [--threads <n>] [--bins <dir>] [--quiet]\n";

static bool g_quiet = false;

static void log_callback(enum ggml_log_level level, const char * text, void * user_data) {
    (void) user_data;
    if (!g_quiet || level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

static double now_ms(void) {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static std::string json_escape(const std::string & s) {
    std::string out;
    for (unsigned char c : s) {
        switch (c) {
            case '"':  out += "\\\""; break;
            case '\\': out += "\\\\"; break;
            case '\n': out += "\\n"; break;
            case '\r': out += "\\r"; break;
            case '\t': out += "\\t"; break;
            default:
                if (c < 0x20) {
                    char buf[8];
                    snprintf(buf, sizeof(buf), "\\u%04x", c);
                    out += buf;
                } else {
                    out += (char) c;
                }
        }
    }
    return out;
}

// as common/arg.cpp's parse_tensor_buffer_overrides: pattern=BUFT, the buffer type by the name of
// a registered device's default buffer type
static bool parse_overrides(const std::string & value, std::vector<llama_model_tensor_buft_override> & out) {
    std::map<std::string, ggml_backend_buffer_type_t> bufts;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(dev);
        if (buft) {
            bufts[ggml_backend_buft_name(buft)] = buft;
        }
    }
    static std::list<std::string> patterns;
    size_t start = 0;
    while (start <= value.size()) {
        size_t comma = value.find(',', start);
        if (comma == std::string::npos) comma = value.size();
        const std::string item = value.substr(start, comma - start);
        const size_t eq = item.find('=');
        if (eq == std::string::npos) {
            fprintf(stderr, "llama-logits: --ot %s: expected <regex>=<buffer type>\n", item.c_str());
            return false;
        }
        const std::string buft = item.substr(eq + 1);
        if (bufts.find(buft) == bufts.end()) {
            fprintf(stderr, "llama-logits: unknown buffer type %s; available:", buft.c_str());
            for (const auto & it : bufts) fprintf(stderr, " %s", it.first.c_str());
            fprintf(stderr, " (is GGML_BACKEND_PATH set?)\n");
            return false;
        }
        patterns.push_back(item.substr(0, eq));
        out.push_back({ patterns.back().c_str(), bufts.at(buft) });
        start = comma + 1;
    }
    return true;
}

static std::string default_bins_dir(void) {
    Dl_info info;
    if (dladdr((void *) &llama_backend_init, &info) != 0 && info.dli_fname != nullptr) {
        std::string path = info.dli_fname;
        const size_t slash = path.rfind('/');
        if (slash != std::string::npos) return path.substr(0, slash);
    }
    return ".";
}

// resident set now, KiB (/proc/self/statm), or -1
static long rss_now_kib(void) {
    FILE * f = fopen("/proc/self/statm", "r");
    if (f == nullptr) return -1;
    long pages_total = 0, pages_rss = -1;
    if (fscanf(f, "%ld %ld", &pages_total, &pages_rss) != 2) pages_rss = -1;
    fclose(f);
    return pages_rss < 0 ? -1 : pages_rss * (sysconf(_SC_PAGESIZE) / 1024);
}

static bool parse_int(const char * v, long lo, long hi, long * out) {
    if (v == nullptr) return false;
    char * end = nullptr;
    const long x = strtol(v, &end, 10);
    if (end == v || *end != '\0' || x < lo || x > hi) return false;
    *out = x;
    return true;
}

struct logits_options {
    std::string model_path, prompt = "The swarm", logits_path, ot, bins;
    long n_predict = 16, n_ctx = 512, n_batch = 512, n_ubatch = 512, n_threads = 2;
    bool mmap = true;
};

// -1: go on; otherwise the exit code (--help, a bad argument)
static int parse_args(int argc, char ** argv, logits_options & o) {
    for (int i = 1; i < argc; ++i) {
        const char * a = argv[i];
        const char * v = i + 1 < argc ? argv[i + 1] : nullptr;
        long x = 0;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            fputs(k_usage, stdout);
            return 0;
        } else if (strcmp(a, "--model") == 0 && v) {
            o.model_path = v; ++i;
        } else if (strcmp(a, "--prompt") == 0 && v) {
            o.prompt = v; ++i;
        } else if (strcmp(a, "--logits") == 0 && v) {
            o.logits_path = v; ++i;
        } else if ((strcmp(a, "--ot") == 0 || strcmp(a, "-ot") == 0) && v) {
            o.ot += (o.ot.empty() ? "" : ",") + std::string(v); ++i;
        } else if (strcmp(a, "--bins") == 0 && v) {
            o.bins = v; ++i;
        } else if (strcmp(a, "--n-predict") == 0 && parse_int(v, 0, 1 << 20, &x)) {
            o.n_predict = x; ++i;
        } else if (strcmp(a, "--ctx") == 0 && parse_int(v, 8, 1 << 20, &x)) {
            o.n_ctx = x; ++i;
        } else if (strcmp(a, "--batch") == 0 && parse_int(v, 1, 1 << 20, &x)) {
            o.n_batch = x; ++i;
        } else if (strcmp(a, "--ubatch") == 0 && parse_int(v, 1, 1 << 20, &x)) {
            o.n_ubatch = x; ++i;
        } else if (strcmp(a, "--threads") == 0 && parse_int(v, 1, 512, &x)) {
            o.n_threads = x; ++i;
        } else if (strcmp(a, "--no-mmap") == 0) {
            o.mmap = false;
        } else if (strcmp(a, "--quiet") == 0) {
            g_quiet = true;
        } else {
            fprintf(stderr, "llama-logits: bad argument %s\n%s", a, k_usage);
            return 2;
        }
    }
    if (o.model_path.empty()) {
        fprintf(stderr, "llama-logits: --model is required\n%s", k_usage);
        return 2;
    }
    return -1;
}

// the model (with the -ot overrides, which the caller keeps alive with the model) and one
// context; false after printing why
static bool load_model(const logits_options & o, std::vector<llama_model_tensor_buft_override> & overrides,
        llama_model ** model, llama_context ** ctx) {
    if (!o.ot.empty()) {
        if (!parse_overrides(o.ot, overrides)) return false;
        overrides.push_back({ nullptr, nullptr });
    }
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.load_mode = o.mmap ? LLAMA_LOAD_MODE_MMAP : LLAMA_LOAD_MODE_NONE;
    mp.lazy_mode = LLAMA_LAZY_MODE_OFF;
    mp.tensor_buft_overrides = overrides.empty() ? nullptr : overrides.data();
    *model = llama_model_load_from_file(o.model_path.c_str(), mp);
    if (*model == nullptr) {
        fprintf(stderr, "llama-logits: cannot load %s\n", o.model_path.c_str());
        return false;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) o.n_ctx;
    cp.n_batch = (uint32_t) o.n_batch;
    cp.n_ubatch = (uint32_t) o.n_ubatch;
    cp.n_threads = (int32_t) o.n_threads;
    cp.n_threads_batch = (int32_t) o.n_threads;
    cp.no_perf = true;
    *ctx = llama_init_from_model(*model, cp);
    if (*ctx == nullptr) {
        fprintf(stderr, "llama-logits: cannot create the context\n");
        llama_model_free(*model);
        *model = nullptr;
        return false;
    }
    return true;
}

// the prompt's tokens, checked against the context and batch sizes; false after printing why
static bool tokenize_prompt(const logits_options & o, const llama_vocab * vocab, std::vector<llama_token> & tokens) {
    const std::string & prompt = o.prompt;
    tokens.resize(prompt.size() + 16);
    int n = llama_tokenize(vocab, prompt.c_str(), (int32_t) prompt.size(), tokens.data(), (int32_t) tokens.size(),
        llama_vocab_get_add_bos(vocab), true);
    if (n < 0) {
        tokens.resize(-n);
        n = llama_tokenize(vocab, prompt.c_str(), (int32_t) prompt.size(), tokens.data(), (int32_t) tokens.size(),
            llama_vocab_get_add_bos(vocab), true);
    }
    if (n <= 0) {
        fprintf(stderr, "llama-logits: the prompt has no tokens\n");
        return false;
    }
    tokens.resize(n);
    if ((long) tokens.size() + o.n_predict > o.n_ctx || (long) tokens.size() > o.n_batch) {
        fprintf(stderr, "llama-logits: %zu prompt tokens + %ld to predict do not fit --ctx %ld / --batch %ld\n",
            tokens.size(), o.n_predict, o.n_ctx, o.n_batch);
        return false;
    }
    return true;
}

struct logits_run {
    std::vector<llama_token> generated;
    std::vector<float> margins;
    std::string text;
    double prompt_ms = 0, decode_ms = 0;
    int rc = 0;
};

// greedy decoding: the prompt, then n_predict tokens; every step's last logits row goes to lf
static void decode_greedy(llama_context * ctx, const llama_vocab * vocab, std::vector<llama_token> & tokens,
        long n_predict, FILE * lf, const std::string & logits_path, logits_run & run) {
    const int32_t n_vocab = llama_vocab_n_tokens(vocab);
    llama_batch batch = llama_batch_get_one(tokens.data(), (int32_t) tokens.size());
    llama_token next = 0;
    for (long step = 0; step <= n_predict; ++step) {
        const double t0 = now_ms();
        const int32_t r = llama_decode(ctx, batch);
        const double dt = now_ms() - t0;
        if (r != 0) {
            fprintf(stderr, "llama-logits: llama_decode failed (%d) at step %ld\n", r, step);
            run.rc = 1;
            break;
        }
        if (step == 0) run.prompt_ms = dt; else run.decode_ms += dt;
        const float * logits = llama_get_logits_ith(ctx, -1);
        if (lf != nullptr && fwrite(logits, sizeof(float), n_vocab, lf) != (size_t) n_vocab) {
            fprintf(stderr, "llama-logits: cannot write %s\n", logits_path.c_str());
            run.rc = 1;
            break;
        }
        if (step == n_predict) break;
        int32_t best = 0;
        for (int32_t i = 1; i < n_vocab; ++i) {
            if (logits[i] > logits[best]) best = i;
        }
        float second = -INFINITY;
        for (int32_t i = 0; i < n_vocab; ++i) {
            if (i != best && logits[i] > second) second = logits[i];
        }
        run.margins.push_back(logits[best] - second);
        next = best;
        run.generated.push_back(next);
        char piece[256];
        const int32_t np = llama_token_to_piece(vocab, next, piece, sizeof(piece), 0, true);
        if (np > 0) run.text.append(piece, np);
        batch = llama_batch_get_one(&next, 1);
    }
}

// the plugin's own counters (JSON), when it is loaded; "null" otherwise
static std::string plugin_stats(void) {
    std::string plugin = "null";
    if (ggml_backend_reg_t reg = ggml_backend_reg_by_name("MOESWARM")) {
        typedef size_t (*stats_fn)(char *, size_t);
        if (auto fn = (stats_fn) ggml_backend_reg_get_proc_address(reg, "ggml_backend_moeswarm_stats")) {
            std::vector<char> buf(fn(nullptr, 0) + 1);
            fn(buf.data(), buf.size());
            plugin = buf.data();
        }
    }
    return plugin;
}

static void print_report(const std::vector<llama_token> & tokens, const logits_run & run, int32_t n_vocab, double load_ms,
        long rss_load_kib) {
    const std::string plugin = plugin_stats();
    printf("{\"prompt\":[");
    for (size_t i = 0; i < tokens.size(); ++i) printf("%s%d", i ? "," : "", tokens[i]);
    printf("],\"tokens\":[");
    for (size_t i = 0; i < run.generated.size(); ++i) printf("%s%d", i ? "," : "", run.generated[i]);
    printf("],\"margins\":[");
    for (size_t i = 0; i < run.margins.size(); ++i) printf("%s%.9g", i ? "," : "", run.margins[i]);
    rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    printf("],\"text\":\"%s\",\"nVocab\":%d,\"ok\":%s,\"loadMs\":%.3f,\"promptMs\":%.3f,\"decodeMs\":%.3f,"
        "\"rssLoadKiB\":%ld,\"maxRssKiB\":%ld,\"plugin\":%s}\n",
        json_escape(run.text).c_str(), n_vocab, run.rc == 0 ? "true" : "false", load_ms, run.prompt_ms, run.decode_ms,
        rss_load_kib, (long) ru.ru_maxrss, plugin.c_str());
    fflush(stdout);
}

int main(int argc, char ** argv) {
    logits_options o;
    const int parsed = parse_args(argc, argv, o);
    if (parsed >= 0) {
        return parsed;
    }

    llama_log_set(log_callback, nullptr);
    ggml_backend_load_all_from_path((o.bins.empty() ? default_bins_dir() : o.bins).c_str());
    llama_backend_init();

    const double t_load = now_ms();
    std::vector<llama_model_tensor_buft_override> overrides;
    llama_model * model = nullptr;
    llama_context * ctx = nullptr;
    if (!load_model(o, overrides, &model, &ctx)) {
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const double load_ms = now_ms() - t_load;
    const long rss_load_kib = rss_now_kib();

    std::vector<llama_token> tokens;
    if (!tokenize_prompt(o, vocab, tokens)) {
        return 1;
    }
    FILE * lf = nullptr;
    if (!o.logits_path.empty()) {
        lf = fopen(o.logits_path.c_str(), "wb");
        if (lf == nullptr) {
            fprintf(stderr, "llama-logits: cannot write %s\n", o.logits_path.c_str());
            return 1;
        }
    }
    logits_run run;
    decode_greedy(ctx, vocab, tokens, o.n_predict, lf, o.logits_path, run);
    if (lf != nullptr) fclose(lf);
    print_report(tokens, run, llama_vocab_n_tokens(vocab), load_ms, rss_load_kib);

    llama_free(ctx);
    llama_model_free(model);
    return run.rc;
}
