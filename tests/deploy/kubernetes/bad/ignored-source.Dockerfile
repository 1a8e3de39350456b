# Copies a directory that its own ignore file (ignored-source.Dockerfile.dockerignore)
# leaves out of the context (checked with --context).
# expect: COPY source policies/ is left out of the context by ignored-source.Dockerfile.dockerignore
FROM debian:12 AS build
WORKDIR /src
COPY CMakeLists.txt ./
COPY policies/ policies/
RUN cmake -S . -B build && cmake --build build --target deltad
