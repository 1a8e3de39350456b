# The daemon's building blocks that need neither gRPC nor CUDA: the host
# pool. Included by daemon/CMakeLists.txt, which adds
# more sources to this library with target_sources().
add_library(deltad_daemon_core STATIC
  ${CMAKE_CURRENT_LIST_DIR}/chunk_ledger.cc
  ${CMAKE_CURRENT_LIST_DIR}/host_pool.cc
)
target_include_directories(deltad_daemon_core PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(deltad_daemon_core
  PUBLIC deltad_common absl::status absl::statusor absl::strings absl::synchronization
         absl::span absl::flat_hash_map
  PRIVATE deltad_warnings)
