# Precompiled headers. Most of a build's time here went to parsing the same
# headers (the standard library, Abseil, protobuf, gRPC) in every file: 4 to
# 7 of a daemon file's 6 to 11 s at -O2 (docs/DEVELOPING.md). A target of
# many files precompiles them once (for its own flags: -fPIC, definitions and
# sanitizers differ between targets) and each file starts from them.
# -DDELTAD_PCH=OFF builds without, e.g. to check that every file includes
# what it uses.
option(DELTAD_PCH "Precompile the headers most files include" ON)

set(deltad_pch_std <algorithm> <chrono> <cstdint> <functional> <map>
    <memory> <mutex> <string> <thread> <utility> <vector>)
set(deltad_pch_absl <absl/container/flat_hash_map.h> <absl/status/status.h>
    <absl/status/statusor.h> <absl/strings/str_cat.h>
    <absl/strings/string_view.h>)
set(deltad_pch_proto [["deltad/v1/memory_manager.pb.h"]])
set(deltad_pch_grpc <grpcpp/grpcpp.h>
    [["deltad/v1/memory_manager.grpc.pb.h"]])

# deltad_precompile_headers(target [PROTO] [GRPC]): the target's files start
# from the standard library's and Abseil's headers, with PROTO the
# protocol's messages, with GRPC gRPC's and the service's as well. Only for
# targets of many files: each precompiles its own (a few seconds).
function(deltad_precompile_headers target)
  if(NOT DELTAD_PCH)
    return()
  endif()
  set(headers ${deltad_pch_std} ${deltad_pch_absl})
  if("PROTO" IN_LIST ARGN OR "GRPC" IN_LIST ARGN)
    list(APPEND headers ${deltad_pch_proto})
  endif()
  if("GRPC" IN_LIST ARGN)
    list(APPEND headers ${deltad_pch_grpc})
  endif()
  target_precompile_headers(${target} PRIVATE ${headers})
endfunction()
