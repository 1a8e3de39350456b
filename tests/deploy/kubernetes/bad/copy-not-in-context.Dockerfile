# Copies a directory the repository does not have (checked with --context).
# expect: COPY source daemons/ is not in the build context
FROM debian:12 AS build
WORKDIR /src
COPY CMakeLists.txt ./
COPY daemons/ daemons/
RUN cmake -S . -B build && cmake --build build --target deltad
