// The translation unit that the tests' precompiled headers
// (tests/CMakeLists.txt) are built for; it has no code of its own.
