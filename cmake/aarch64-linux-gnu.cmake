# Cross build for 64-bit ARM Linux with Debian's gcc-aarch64-linux-gnu; ctest runs the binaries under qemu-aarch64
# (Debian's qemu-user), whose default CPU model ("max") has the Armv8.2 dot product and fp16 the NEON kernels use.
# Used with -DBATON_ENGINE_ONLY=ON (`make test-neon`): the service libraries have no arm64 packages installed here.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64;-L;/usr/aarch64-linux-gnu)
