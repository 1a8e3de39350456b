// The C API from C++: the header's extern "C" block, with warnings on.
#include <deltad/deltad_client.h>

#include <cstdio>

int main() {
  deltad_client_options options;
  deltad_client_options_init(&options);
  if (options.use_daemon != 1 || options.socket_path == nullptr) {
    std::fprintf(stderr, "consumer_cxx: unexpected defaults\n");
    return 1;
  }
  std::printf("consumer_cxx: default socket %s\n", options.socket_path);
  return 0;
}
