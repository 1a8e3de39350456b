# A build stage that copies too little for CMake to configure (checked
# with --context and --cmake): the top-level CMakeLists.txt adds
# common/, policies/ and the rest.
# expect: CMake cannot configure from what the build stage copies
FROM debian:12 AS build
WORKDIR /src
COPY CMakeLists.txt ./
COPY daemon/ daemon/
RUN cmake -S . -B build -G Ninja && cmake --build build --target deltad
