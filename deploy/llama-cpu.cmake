# Read by llama.cpp's own project() (CMAKE_PROJECT_llama.cpp_INCLUDE, set by the Makefile's
# CMAKE_ARGS): llama-cpp-python forces llama.cpp's `common` library on, which its Python
# package never loads; skipping it (and the HTTP client it pulls in) halves the compile.
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "llama.cpp's common utils: unused by the bindings" FORCE)
