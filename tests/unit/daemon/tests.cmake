# Included by tests/unit/daemon/CMakeLists.txt, which defines
# deltad_daemon_test(name sources...).
deltad_daemon_test(host_pool_test host_pool_test.cc)
deltad_daemon_test(chunk_ledger_test chunk_ledger_test.cc)
