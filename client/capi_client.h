// The handle behind the C API (deltad_client.h), shared by the files that
// implement it: c_api.cc (clients and tensors) and torch_allocator.cc (the
// allocator entry points). Not installed; not for callers.
#ifndef DELTAD_CLIENT_CAPI_CLIENT_H_
#define DELTAD_CLIENT_CAPI_CLIENT_H_

#include <memory>

#include "absl/status/status.h"
#include "client/client.h"
#include "client/deltad_client.h"
#ifdef DELTAD_HAVE_CUDA
#include "client/cuda_device.h"
#endif

struct deltad_client {
  std::unique_ptr<deltad::client::Client> impl;
  // The CUDA ordinal of a "cuda" device; -1 for the simulated ones, which
  // stand in for any device index.
  int cuda_ordinal = -1;
#ifdef DELTAD_HAVE_CUDA
  deltad::client::CudaDevice* cuda = nullptr;  // owned by impl
#endif
};

namespace deltad::client::capi {

// Keeps the status's message for deltad_last_error() (the calling
// thread's) and returns its code; 0 for OK.
int Report(const absl::Status& status);

// Before `client` is closed: detaches it from the allocator if it is the
// attached one, and forgets its live blocks (their memory goes with the
// client, and a later free of one is ignored). Waits for allocator calls
// using it to return. Defined in torch_allocator.cc.
void ForgetAllocatorClient(deltad_client* client);

}  // namespace deltad::client::capi

#endif  // DELTAD_CLIENT_CAPI_CLIENT_H_
