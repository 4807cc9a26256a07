#pragma once

// How a request's k expert outputs per token come back (the protocol's "mode"), shared by the
// frame codec and the compute core.

enum moeswarm_mode {
    MOESWARM_MODE_EACH = 0, // y[(i*k + j)*n_embd ...]: the output of slot j of token i, zero for empty slots
    MOESWARM_MODE_SUM  = 1, // y[i*n_embd ...]: sum_j w_ij*y_ij, products rounded to f32, added in slot order
};
