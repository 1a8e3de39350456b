deltad_daemon_test(sim_backend_test sim_backend_test.cc)
if(DELTAD_HAVE_CUDA)
  deltad_daemon_test(cuda_backend_test cuda_backend_test.cc)
endif()
