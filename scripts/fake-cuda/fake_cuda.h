// What the stand-in driver's two files share: fake_cuda.c (device, memory, streams, events) and
// launch.c (modules, functions, launches, TMA descriptors, and the driver's refusals).
#include <cuda.h>

extern unsigned long long launches, modules, refused;
