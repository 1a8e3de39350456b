# Device backends of the daemon. Included after deltad_daemon_core is defined.
target_sources(deltad_daemon_core PRIVATE ${CMAKE_CURRENT_LIST_DIR}/sim_backend.cc)
