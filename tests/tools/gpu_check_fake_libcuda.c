/* A stand-in for libcuda.so.1 with the calls tools/gpu_check/vmm.py makes, for tests/tools/test_gpu_check.py.
 *
 * It holds no GPU: it keeps books of a 1 GiB device (FAKE_TOTAL) and checks what it is given the
 * way the driver would refuse it: a wrong allocation property or access descriptor, a size that
 * is not a multiple of the granularity, an unknown handle, a map outside a reserved range, or a
 * call before cuInit.  cuMemCreate and cuMemAlloc fail with CUDA_ERROR_OUT_OF_MEMORY (2) once the
 * device is full.  Built with `cc -shared -fPIC`.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define FAKE_TOTAL (1ULL << 30)
#define GRANULARITY (2ULL << 20)
#define MAX_HANDLES 4096
#define OK 0
#define INVALID_VALUE 1
#define OUT_OF_MEMORY 2
#define NOT_INITIALIZED 3

typedef struct { int type; int id; } Location;
typedef struct { int type; int handle_types; Location location; void *win32; unsigned char flags[8]; } Prop;
typedef struct { Location location; int flags; } Access;

static int initialised = 0;
static unsigned long long used = 0;
static unsigned long long handle_size[MAX_HANDLES]; /* 0: free slot; handle = slot + 1 */
static unsigned long long reserved_base = 0, reserved_size = 0;
static int mapped_pages = 0;

static int prop_ok(const Prop *p) {
    return p && p->type == 1 && p->handle_types == 0 && p->location.type == 1 && p->location.id == 0;
}

int cuInit(unsigned int flags) { initialised = (flags == 0); return flags == 0 ? OK : INVALID_VALUE; }
int cuDeviceGet(int *dev, int ordinal) { if (!initialised) return NOT_INITIALIZED; *dev = ordinal; return ordinal == 0 ? OK : INVALID_VALUE; }
int cuDevicePrimaryCtxRetain(void **ctx, int dev) { *ctx = (void *)0x1234; return dev == 0 ? OK : INVALID_VALUE; }
int cuDevicePrimaryCtxRelease_v2(int dev) { return dev == 0 ? OK : INVALID_VALUE; }
int cuCtxSetCurrent(void *ctx) { return ctx == (void *)0x1234 ? OK : INVALID_VALUE; }
int cuCtxSynchronize(void) { return OK; }

int cuMemGetInfo_v2(size_t *free_bytes, size_t *total) { *free_bytes = FAKE_TOTAL - used; *total = FAKE_TOTAL; return OK; }

int cuMemGetAllocationGranularity(size_t *granularity, const Prop *prop, int option) {
    if (!prop_ok(prop) || option != 0) return INVALID_VALUE;
    *granularity = GRANULARITY;
    return OK;
}

int cuMemAddressReserve(unsigned long long *ptr, size_t size, size_t alignment, unsigned long long addr, unsigned long long flags) {
    if (size == 0 || size % GRANULARITY || addr || flags || reserved_size) return INVALID_VALUE;
    (void)alignment;
    reserved_base = 1ULL << 40;
    reserved_size = size;
    *ptr = reserved_base;
    return OK;
}

int cuMemAddressFree(unsigned long long ptr, size_t size) {
    if (ptr != reserved_base || size != reserved_size || mapped_pages) return INVALID_VALUE;
    reserved_size = 0;
    return OK;
}

int cuMemCreate(unsigned long long *handle, size_t size, const Prop *prop, unsigned long long flags) {
    if (!prop_ok(prop) || flags || size == 0 || size % GRANULARITY) return INVALID_VALUE;
    if (used + size > FAKE_TOTAL) return OUT_OF_MEMORY;
    for (int i = 0; i < MAX_HANDLES; i++) {
        if (!handle_size[i]) {
            handle_size[i] = size;
            used += size;
            *handle = (unsigned long long)i + 1;
            return OK;
        }
    }
    return OUT_OF_MEMORY;
}

int cuMemRelease(unsigned long long handle) {
    if (handle == 0 || handle > MAX_HANDLES || !handle_size[handle - 1]) return INVALID_VALUE;
    used -= handle_size[handle - 1];
    handle_size[handle - 1] = 0;
    return OK;
}

int cuMemMap(unsigned long long ptr, size_t size, size_t offset, unsigned long long handle, unsigned long long flags) {
    if (handle == 0 || handle > MAX_HANDLES || handle_size[handle - 1] != size || offset || flags) return INVALID_VALUE;
    if (ptr < reserved_base || ptr + size > reserved_base + reserved_size || (ptr - reserved_base) % GRANULARITY) return INVALID_VALUE;
    mapped_pages++;
    return OK;
}

int cuMemSetAccess(unsigned long long ptr, size_t size, const Access *desc, size_t count) {
    if (!desc || count != 1 || desc->location.type != 1 || desc->location.id != 0 || desc->flags != 3) return INVALID_VALUE;
    if (ptr < reserved_base || ptr + size > reserved_base + reserved_size) return INVALID_VALUE;
    return OK;
}

int cuMemUnmap(unsigned long long ptr, size_t size) {
    if (ptr < reserved_base || ptr + size > reserved_base + reserved_size || mapped_pages <= 0) return INVALID_VALUE;
    mapped_pages--;
    return OK;
}

int cuMemAlloc_v2(unsigned long long *ptr, size_t size) {
    if (size == 0) return INVALID_VALUE;
    if (used + size > FAKE_TOTAL) return OUT_OF_MEMORY;
    used += size;
    *ptr = (2ULL << 40) + size; /* the size rides in the pointer, for cuMemFree */
    return OK;
}

int cuMemFree_v2(unsigned long long ptr) {
    unsigned long long size = ptr - (2ULL << 40);
    if (size == 0 || size > used) return INVALID_VALUE;
    used -= size;
    return OK;
}

int cuGetErrorName(int code, const char **name) {
    static const char *names[] = {"CUDA_SUCCESS", "CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_OUT_OF_MEMORY",
                                  "CUDA_ERROR_NOT_INITIALIZED"};
    if (code < 0 || code > 3) return INVALID_VALUE;
    *name = names[code];
    return OK;
}
