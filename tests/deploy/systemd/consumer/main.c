/* A trainer in C against the installed SDK: a client without a daemon
 * (in-process policy, simulated device), one tensor tracked, written,
 * unpinned, pinned again and checked, then freed. Exits 0 on success. */
#include <deltad/deltad_client.h>
#include <stdio.h>
#include <string.h>

static int failed(const char* what, int rc) {
  fprintf(stderr, "consumer: %s returned %d: %s\n", what, rc,
          deltad_last_error());
  return 1;
}

int main(void) {
  deltad_client_options options;
  deltad_client* client = NULL;
  deltad_tensor_info info;
  deltad_client_stats stats;
  const int64_t bytes = (int64_t)1 << 20;
  unsigned char* data = NULL;
  void* out = NULL;
  int64_t i;
  int rc;

  deltad_client_options_init(&options);
  options.use_daemon = 0;
  options.label = "install_test consumer";
  options.device = "sim";
  options.sim_memory_bytes = (int64_t)64 << 20;
  options.fallback_budget_bytes = (int64_t)16 << 20;
  options.fallback_host_bytes = (int64_t)16 << 20;
  rc = deltad_client_connect(&options, &client);
  if (rc != 0) return failed("deltad_client_connect", rc);

  memset(&info, 0, sizeof info);
  info.id = 1;
  info.bytes = bytes;
  info.compute_cost_ns = 1000;
  info.uncomputable = 1;
  rc = deltad_track(client, &info, NULL, NULL, &out);
  if (rc != 0) return failed("deltad_track", rc);
  memset(out, 0x5a, (size_t)bytes);
  deltad_unpin(client, 1);

  rc = deltad_pin(client, 1, &out);
  if (rc != 0) return failed("deltad_pin", rc);
  data = (unsigned char*)out;
  for (i = 0; i < bytes; ++i) {
    if (data[i] != 0x5a) {
      fprintf(stderr, "consumer: byte %lld is 0x%02x after pin\n", (long long)i,
              data[i]);
      return 1;
    }
  }
  deltad_unpin(client, 1);

  rc = deltad_stats(client, &stats);
  if (rc != 0) return failed("deltad_stats", rc);
  if (stats.connected != 0 || stats.device_bytes < bytes) {
    fprintf(stderr, "consumer: stats say connected=%d device_bytes=%lld\n",
            (int)stats.connected, (long long)stats.device_bytes);
    return 1;
  }
  rc = deltad_free(client, 1);
  if (rc != 0) return failed("deltad_free", rc);
  deltad_client_close(client);
  printf("consumer: tracked, pinned and freed 1 MiB without a daemon\n");
  return 0;
}
