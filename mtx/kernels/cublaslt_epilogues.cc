// Matmuls with their element-wise neighbours in cuBLASLt's epilogues, as XLA FFI handlers.
//
// mtx/kernels/gemm_epilogue.py builds this file on a host with NVIDIA GPUs and calls it from JAX; read it there
// first. All matrices are bf16, row-major as JAX holds them; cuBLASLt is column-major, so each row-major product
// C (M, N) = A (M, K) B (K, N) is computed as its transpose C^T = B^T A^T, the bias (or its gradient) running along
// the N output columns, which are cuBLASLt's rows.
//
//   mtx_gemm_bias:   x (..., K), w (K, N), b (N) -> x w + b                            (epilogue BIAS)
//   mtx_gemm_gelu:   x (..., K), w (K, N), b (N) -> gelu(x w + b), h = x w + b         (epilogue GELU_AUX_BIAS)
//   mtx_gemm_dgelu:  dy (..., K), w (N, K), h (..., N) -> dh = (dy w^T) * gelu'(h)     (epilogue DGELU)
//
// (Not DGELU_BGRAD, which sums dh's columns for the bias gradient too: measured slower than DGELU and XLA's own
// column sums together, docs/benchmarks.md 21.)
//
// (x's and dy's leading dimensions are the M rows: the activations keep their (micro batch, sequence) shape.)
//
// GeLU is cuBLASLt's tanh approximation (GPT-2's). The accumulation and the epilogue run in float32; h, the outputs
// and db are rounded to bf16 once. Each problem's algorithm is chosen once per device, shape and pointer alignment:
// the heuristic's candidates are timed on the call's own buffers, which the chosen one then overwrites.

#include <cstdint>
#include <initializer_list>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "xla/ffi/api/ffi.h"

// The part of cuBLASLt's and the CUDA runtime's C API used here, declared as their headers declare it (the same in
// CUDA 12 and 13): the build needs their shared libraries only, not their headers, which the pip packages JAX's
// CUDA plugin installs ship incomplete (they include headers of packages it does not install).
extern "C" {
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
typedef int cudaError_t;  // cudaSuccess = 0
cudaError_t cudaEventCreate(cudaEvent_t* event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end);
cudaError_t cudaEventDestroy(cudaEvent_t event);

typedef int cublasStatus_t;  // CUBLAS_STATUS_SUCCESS = 0
typedef struct cublasLtContext* cublasLtHandle_t;
typedef struct cublasLtMatmulDescOpaque_st* cublasLtMatmulDesc_t;
typedef struct cublasLtMatrixLayoutOpaque_st* cublasLtMatrixLayout_t;
typedef struct cublasLtMatmulPreferenceOpaque_st* cublasLtMatmulPreference_t;
typedef struct {
  uint64_t data[8];
} cublasLtMatmulAlgo_t;
typedef struct {
  cublasLtMatmulAlgo_t algo;
  size_t workspaceSize;
  cublasStatus_t state;
  float wavesCount;
  int reserved[4];
} cublasLtMatmulHeuristicResult_t;
cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle);
const char* cublasLtGetStatusString(cublasStatus_t status);
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, int compute_type, int scale_type);
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc);
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, int attribute, const void* value,
                                              size_t size);
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, int type, uint64_t rows, uint64_t cols,
                                          int64_t ld);
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout);
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* preference);
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t preference);
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t preference, int attribute,
                                                    const void* value, size_t size);
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                              cublasLtMatmulPreference_t preference, int requested,
                                              cublasLtMatmulHeuristicResult_t* results, int* returned);
cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha, const void* a,
                              cublasLtMatrixLayout_t a_layout, const void* b, cublasLtMatrixLayout_t b_layout,
                              const void* beta, const void* c, cublasLtMatrixLayout_t c_layout, void* d,
                              cublasLtMatrixLayout_t d_layout, const cublasLtMatmulAlgo_t* algo, void* workspace,
                              size_t workspace_bytes, cudaStream_t stream);
}

// Their enumerations' values (library_types.h, cublas_api.h, cublasLt.h).
enum : int { CUDA_R_32F = 0, CUDA_R_16BF = 14, CUBLAS_COMPUTE_32F = 68, CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 };
enum : int {
  CUBLASLT_MATMUL_DESC_TRANSA = 3,
  CUBLASLT_MATMUL_DESC_EPILOGUE = 7,
  CUBLASLT_MATMUL_DESC_BIAS_POINTER = 8,
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER = 11,
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD = 12,
  CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1,
};
enum cublasLtEpilogue_t : uint32_t {
  CUBLASLT_EPILOGUE_BIAS = 4,
  CUBLASLT_EPILOGUE_GELU_AUX_BIAS = 32 | 128 | 4,  // GELU | AUX | BIAS
  CUBLASLT_EPILOGUE_DGELU = 64 | 128,              // DGELU (with its AUX input)
};
constexpr cublasStatus_t CUBLAS_STATUS_SUCCESS = 0;
constexpr cudaError_t cudaSuccess = 0;

namespace ffi = xla::ffi;

namespace {

constexpr int kCandidates = 8;
constexpr int kTimedRuns = 3;

using Matrix = ffi::Buffer<ffi::BF16, 2>;
using Rows = ffi::Buffer<ffi::BF16>;  // (..., width): rows of any leading shape
using Vector = ffi::Buffer<ffi::BF16, 1>;
using Stream = ffi::PlatformStream<cudaStream_t>;
using Bytes = ffi::Buffer<ffi::U8, 1>;
using Workspace = ffi::Result<Bytes>;

#define MTX_CUBLAS(expr)                                                                      \
  do {                                                                                        \
    cublasStatus_t status_ = (expr);                                                          \
    if (status_ != CUBLAS_STATUS_SUCCESS)                                                     \
      return ffi::Error::Internal(std::string(#expr) + ": " + cublasLtGetStatusString(status_)); \
  } while (0)

// One product: D (rows, cols) = op(A) (rows, depth) B (depth, cols), all column-major, with an epilogue.
struct Problem {
  int device;
  cublasLtEpilogue_t epilogue;
  bool transpose_a;  // A stored (depth, rows) rather than (rows, depth)
  int64_t rows, cols, depth;
  int alignment = 0;  // of the call's pointers (up to 256 bytes): cuBLASLt's heuristic picks algorithms by it
  auto key() const {
    return std::make_tuple(device, static_cast<int>(epilogue), transpose_a, rows, cols, depth, alignment);
  }
};

// The largest power of two up to 256 dividing every pointer's address.
int Alignment(std::initializer_list<const void*> pointers) {
  uintptr_t bits = 256;
  for (const void* pointer : pointers) bits |= reinterpret_cast<uintptr_t>(pointer);
  return static_cast<int>(bits & (~bits + 1));
}

std::mutex mutex;
std::map<int, cublasLtHandle_t> handles;
std::map<decltype(Problem{}.key()), cublasLtMatmulAlgo_t> algorithms;

// The descriptors of one call (they hold its pointers), destroyed with it.
struct Descriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  ~Descriptors() {
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

ffi::Error Describe(const Problem& p, const void* bias, const void* aux, Descriptors& desc) {
  MTX_CUBLAS(cublasLtMatmulDescCreate(&desc.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  int32_t op_a = p.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  MTX_CUBLAS(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  uint32_t epilogue = p.epilogue;
  MTX_CUBLAS(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
  if (bias)
    MTX_CUBLAS(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  if (aux) {
    MTX_CUBLAS(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
    int64_t aux_ld = p.rows;
    MTX_CUBLAS(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld,
                                              sizeof(aux_ld)));
  }
  MTX_CUBLAS(p.transpose_a ? cublasLtMatrixLayoutCreate(&desc.a, CUDA_R_16BF, p.depth, p.rows, p.depth)
                           : cublasLtMatrixLayoutCreate(&desc.a, CUDA_R_16BF, p.rows, p.depth, p.rows));
  MTX_CUBLAS(cublasLtMatrixLayoutCreate(&desc.b, CUDA_R_16BF, p.depth, p.cols, p.depth));
  MTX_CUBLAS(cublasLtMatrixLayoutCreate(&desc.d, CUDA_R_16BF, p.rows, p.cols, p.rows));
  return ffi::Error::Success();
}

ffi::Error Handle(int device, cublasLtHandle_t& handle) {
  std::lock_guard<std::mutex> lock(mutex);
  auto found = handles.find(device);
  if (found == handles.end()) {
    MTX_CUBLAS(cublasLtCreate(&handle));
    handles[device] = handle;
  } else {
    handle = found->second;
  }
  return ffi::Error::Success();
}

// D = op(A) B with `algo`, the epilogue's pointers in the descriptors.
cublasStatus_t Run(cublasLtHandle_t handle, const Descriptors& desc, const cublasLtMatmulAlgo_t* algo, const void* a,
                   const void* b, void* d, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const float one = 1.0f, zero = 0.0f;
  return cublasLtMatmul(handle, desc.op, &one, a, desc.a, b, desc.b, &zero, d, desc.d, d, desc.d, algo, workspace,
                        workspace_bytes, stream);
}

// The fastest of the heuristic's candidates on this call's buffers (each run writes what the final run overwrites).
ffi::Error Choose(const Problem& p, cublasLtHandle_t handle, const Descriptors& desc, cudaStream_t stream,
                  const void* a, const void* b, void* d, void* workspace, size_t workspace_bytes,
                  cublasLtMatmulAlgo_t& chosen) {
  cublasLtMatmulPreference_t preference;
  MTX_CUBLAS(cublasLtMatmulPreferenceCreate(&preference));
  cublasStatus_t status = cublasLtMatmulPreferenceSetAttribute(
      preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof(workspace_bytes));
  std::vector<cublasLtMatmulHeuristicResult_t> results(kCandidates);
  int found = 0;
  if (status == CUBLAS_STATUS_SUCCESS)
    status = cublasLtMatmulAlgoGetHeuristic(handle, desc.op, desc.a, desc.b, desc.d, desc.d, preference,
                                            kCandidates, results.data(), &found);
  cublasLtMatmulPreferenceDestroy(preference);
  MTX_CUBLAS(status);
  if (found == 0)
    return ffi::Error::Internal("cuBLASLt has no algorithm for epilogue " + std::to_string(p.epilogue) + " at " +
                                std::to_string(p.rows) + " x " + std::to_string(p.cols) + " x " +
                                std::to_string(p.depth));
  auto run = [&](const cublasLtMatmulAlgo_t* algo) {
    return Run(handle, desc, algo, a, b, d, workspace, workspace_bytes, stream) == CUBLAS_STATUS_SUCCESS;
  };
  cudaEvent_t start = nullptr, stop = nullptr;
  bool timed = cudaEventCreate(&start) == cudaSuccess && cudaEventCreate(&stop) == cudaSuccess;
  float best = -1.0f;
  for (int i = 0; timed && i < found; ++i) {
    const cublasLtMatmulAlgo_t* algo = &results[i].algo;
    if (!run(algo) || cudaEventRecord(start, stream) != cudaSuccess) continue;  // a candidate that cannot run here
    bool ran = true;
    for (int repeat = 0; repeat < kTimedRuns; ++repeat) ran = run(algo) && ran;
    float ms = 0.0f;
    if (!ran || cudaEventRecord(stop, stream) != cudaSuccess || cudaEventSynchronize(stop) != cudaSuccess ||
        cudaEventElapsedTime(&ms, start, stop) != cudaSuccess)
      continue;
    if (best < 0.0f || ms < best) {
      best = ms;
      chosen = *algo;
    }
  }
  if (start) cudaEventDestroy(start);
  if (stop) cudaEventDestroy(stop);
  if (best < 0.0f) chosen = results[0].algo;  // none timed: the heuristic's first (the final call says if it fails)
  return ffi::Error::Success();
}

ffi::Error Matmul(const Problem& p, cudaStream_t stream, Workspace& workspace, const void* a, const void* b, void* d,
                  const void* bias, const void* aux) {
  cublasLtHandle_t handle;
  if (ffi::Error error = Handle(p.device, handle); error.failure()) return error;
  Descriptors desc;
  if (ffi::Error error = Describe(p, bias, aux, desc); error.failure()) return error;
  void* space = workspace->untyped_data();
  size_t space_bytes = workspace->size_bytes();  // as large as the caller made it (gemm_epilogue.WORKSPACE_BYTES)
  cublasLtMatmulAlgo_t algo;
  bool known;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto found = algorithms.find(p.key());
    known = found != algorithms.end();
    if (known) algo = found->second;
  }
  if (!known) {
    ffi::Error error = Choose(p, handle, desc, stream, a, b, d, space, space_bytes, algo);
    if (error.failure()) return error;
    std::lock_guard<std::mutex> lock(mutex);
    algorithms[p.key()] = algo;
  }
  MTX_CUBLAS(Run(handle, desc, &algo, a, b, d, space, space_bytes, stream));
  return ffi::Error::Success();
}

// (..., width) -> (rows, width)
std::tuple<int64_t, int64_t> Shape(const Rows& a) {
  auto dims = a.dimensions();
  int64_t width = dims.size() ? dims[dims.size() - 1] : 1;
  return {width ? static_cast<int64_t>(a.element_count()) / width : 0, width};
}

ffi::Error GemmBias(cudaStream_t stream, int32_t device, Rows x, Matrix w, Vector bias, ffi::Result<Rows> out,
                    Workspace workspace) {
  auto [m, k] = Shape(x);
  int64_t n = w.dimensions()[1];
  if (w.dimensions()[0] != k || bias.dimensions()[0] != n || Shape(*out) != std::make_tuple(m, n))
    return ffi::Error::InvalidArgument("mtx_gemm_bias: x (..., K), w (K, N), b (N) and the output do not match");
  Problem p{device, CUBLASLT_EPILOGUE_BIAS, false, n, m, k};
  p.alignment = Alignment({x.untyped_data(), w.untyped_data(), bias.untyped_data(), out->untyped_data()});
  return Matmul(p, stream, workspace, w.untyped_data(), x.untyped_data(), out->untyped_data(), bias.untyped_data(),
                nullptr);
}

ffi::Error GemmGelu(cudaStream_t stream, int32_t device, Rows x, Matrix w, Vector bias, ffi::Result<Rows> out,
                    ffi::Result<Rows> h, Workspace workspace) {
  auto [m, k] = Shape(x);
  int64_t n = w.dimensions()[1];
  if (w.dimensions()[0] != k || bias.dimensions()[0] != n || Shape(*out) != std::make_tuple(m, n) ||
      Shape(*h) != std::make_tuple(m, n))
    return ffi::Error::InvalidArgument("mtx_gemm_gelu: x (..., K), w (K, N), b (N) and the outputs do not match");
  Problem p{device, CUBLASLT_EPILOGUE_GELU_AUX_BIAS, false, n, m, k};
  p.alignment = Alignment({x.untyped_data(), w.untyped_data(), bias.untyped_data(), out->untyped_data(),
                           h->untyped_data()});
  return Matmul(p, stream, workspace, w.untyped_data(), x.untyped_data(), out->untyped_data(), bias.untyped_data(),
                h->untyped_data());
}

ffi::Error GemmDgelu(cudaStream_t stream, int32_t device, Rows dy, Matrix w, Rows h, ffi::Result<Rows> dh,
                     Workspace workspace) {
  auto [m, k] = Shape(dy);
  int64_t n = w.dimensions()[0];
  if (w.dimensions()[1] != k || Shape(h) != std::make_tuple(m, n) || Shape(*dh) != std::make_tuple(m, n))
    return ffi::Error::InvalidArgument("mtx_gemm_dgelu: dy (..., K), w (N, K), h (..., N) and the output do not "
                                       "match");
  Problem p{device, CUBLASLT_EPILOGUE_DGELU, true, n, m, k};
  p.alignment = Alignment({dy.untyped_data(), w.untyped_data(), h.untyped_data(), dh->untyped_data()});
  return Matmul(p, stream, workspace, w.untyped_data(), dy.untyped_data(), dh->untyped_data(), nullptr,
                h.untyped_data());
}

// What every handler takes first: the stream, the device, x (or dy) and w.
auto BindOperands() {
  return ffi::Ffi::Bind().Ctx<Stream>().Ctx<ffi::DeviceOrdinal>().Arg<Rows>().Arg<Matrix>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MtxGemmBias, GemmBias, BindOperands().Arg<Vector>().Ret<Rows>().Ret<Bytes>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(MtxGemmGelu, GemmGelu,
                              BindOperands().Arg<Vector>().Ret<Rows>().Ret<Rows>().Ret<Bytes>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(MtxGemmDgelu, GemmDgelu, BindOperands().Arg<Rows>().Ret<Rows>().Ret<Bytes>());
