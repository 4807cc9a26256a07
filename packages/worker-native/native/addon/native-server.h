#pragma once

// The worker's native listener (docs/protocol.md section 10.9), the addon's NativeServer class:
//   new NativeServer({ host, port, cert, key, maxFrame?, id?, onHello })
//     port (0: any free one) and fingerprint readable; onHello(backbone, ticket, remote, done) runs on
//     the JS thread for each connection's hello: done(true) accepts, done(code, message) refuses.
//   setRoutes([{ model, layer, slice: SliceHandle }])   the (model, layer) -> slice table served
//   takeServed() -> [{ backbone, model, expertTokens, requests }] since the last call
//   close()                                             stops and joins everything; idempotent
// It throws MOESWARM_NATIVE_TLS_UNAVAILABLE where OpenSSL 3 cannot be found.

#include <napi.h>

namespace moeswarm_addon {

void native_server_init(Napi::Env env, Napi::Object exports);

} // namespace moeswarm_addon
