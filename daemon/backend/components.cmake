# Device backends of the daemon. Included after deltad_daemon_core is defined.
target_sources(deltad_daemon_core PRIVATE
               ${CMAKE_CURRENT_LIST_DIR}/chunk_request.cc
               ${CMAKE_CURRENT_LIST_DIR}/sim_backend.cc)
if(DELTAD_HAVE_CUDA)
  target_sources(deltad_daemon_core PRIVATE
                 ${CMAKE_CURRENT_LIST_DIR}/cuda_backend.cc)
  target_link_libraries(deltad_daemon_core PUBLIC deltad_cuda)
endif()
