// BLAS inspection and the choice of OpenBLAS core.
#include <gtest/gtest.h>

#include "ddp/blas.h"

namespace ddp {
namespace {

TEST(Blas, CoreLevels) {
  EXPECT_EQ(openblas_core_level("SkylakeX"), 4);
  EXPECT_EQ(openblas_core_level("COOPERLAKE"), 4);
  EXPECT_EQ(openblas_core_level("Haswell"), 3);
  EXPECT_EQ(openblas_core_level("Zen"), 3);
  EXPECT_EQ(openblas_core_level("Sandybridge"), 2);
  EXPECT_EQ(openblas_core_level("Prescott"), 1);
  EXPECT_EQ(openblas_core_level("Nehalem"), 1);
  EXPECT_EQ(openblas_core_level("SomethingNew"), 0);
}

TEST(Blas, BestCoreIsOneThisCpuRuns) {
  const std::string best = best_openblas_core();
  __builtin_cpu_init();
  if (best == "Cooperlake" || best == "SkylakeX") {
    EXPECT_TRUE(__builtin_cpu_supports("avx512f"));
    EXPECT_TRUE(__builtin_cpu_supports("avx512bw"));
    EXPECT_TRUE(__builtin_cpu_supports("avx512vl"));
  }
  if (best == "Cooperlake") EXPECT_TRUE(__builtin_cpu_supports("avx512bf16"));
  if (best == "Haswell") EXPECT_TRUE(__builtin_cpu_supports("avx2"));
  if (!best.empty()) EXPECT_GE(openblas_core_level(best), 2);
}

BlasReport openblas(std::string core, std::string best, std::string user = "") {
  BlasReport r;
  r.vendor = "OpenBLAS";
  r.core = std::move(core);
  r.cpu_best_core = std::move(best);
  r.user_coretype = std::move(user);
  return r;
}

TEST(Blas, OverrideOnlyWhenOpenBlasPickedAWeakerCore) {
  // The AVX-512 Xeon case: OpenBLAS 0.3.21 falls back to SSE3 kernels.
  EXPECT_TRUE(openblas("Prescott", "SkylakeX").needs_core_override());
  EXPECT_TRUE(openblas("Haswell", "Cooperlake").needs_core_override());
  EXPECT_NE(openblas("Prescott", "SkylakeX").summary().find("OPENBLAS_CORETYPE=SkylakeX"),
            std::string::npos);
  // Already the best it can be.
  EXPECT_FALSE(openblas("Cooperlake", "Cooperlake").needs_core_override());
  EXPECT_FALSE(openblas("SkylakeX", "Cooperlake").needs_core_override());
  // The user's own choice always wins.
  EXPECT_FALSE(openblas("Prescott", "SkylakeX", "Prescott").needs_core_override());
  // Unknown core names are left alone; so is a CPU with nothing better to offer.
  EXPECT_FALSE(openblas("Mystery", "SkylakeX").needs_core_override());
  EXPECT_FALSE(openblas("Prescott", "").needs_core_override());
  // Not OpenBLAS: nothing to override, but the reference BLAS gets a warning.
  BlasReport ref;
  ref.vendor = "reference BLAS (netlib)";
  EXPECT_FALSE(ref.needs_core_override());
  EXPECT_NE(ref.summary().find("libopenblas0-pthread"), std::string::npos);
}

TEST(Blas, QuietThreadsOnlyWhereOpenMpAndOpenBlasWouldSpinOnEachOther) {
  BlasReport r = openblas("Haswell", "Haswell");
  r.threading = "pthreads";
  r.rank_threads = 2;
  EXPECT_TRUE(r.needs_quiet_threads());
  EXPECT_NE(r.summary().find("OMP_WAIT_POLICY=passive OPENBLAS_THREAD_TIMEOUT=4"),
            std::string::npos)
      << r.summary();
  r.rank_threads = 1;  // one thread per rank (ddprun's several workers): nothing spins
  EXPECT_FALSE(r.needs_quiet_threads());
  r.rank_threads = 2;
  r.wait_policy = "active";  // the user's choice wins; the other setting is still missing
  EXPECT_TRUE(r.needs_quiet_threads());
  r.thread_timeout = "28";
  EXPECT_FALSE(r.needs_quiet_threads());
  r.wait_policy.clear();
  r.thread_timeout.clear();
  r.threading = "OpenMP";  // one OpenMP pool for both: nothing to fight over
  EXPECT_FALSE(r.needs_quiet_threads());
}

// What a launcher gives a worker: what ensure_fast_blas would re-execute it to set.
TEST(Blas, ALaunchersWorkerEnvironmentIsWhatTheReexecWouldSet) {
  BlasReport r = openblas("Haswell", "Cooperlake");
  r.threading = "pthreads";
  // Several workers, one thread each (ddprun's OMP_NUM_THREADS=1): the core only.
  EXPECT_EQ(fast_blas_environment(r, {{"LOCAL_WORLD_SIZE", "2"}, {"OMP_NUM_THREADS", "1"}}),
            (EnvMap{{"OPENBLAS_CORETYPE", "Cooperlake"}, {"DDP_BLAS_CHOSEN", "core"}}));
  // Several threads beside OpenBLAS's own: the idle threads sleep too.
  EXPECT_EQ(fast_blas_environment(r, {{"OMP_NUM_THREADS", "2"}}),
            (EnvMap{{"OPENBLAS_CORETYPE", "Cooperlake"},
                    {"OMP_WAIT_POLICY", "passive"},
                    {"OPENBLAS_THREAD_TIMEOUT", "4"},
                    {"DDP_BLAS_CHOSEN", "core,wait"}}));
  // The worker's own settings win, each alone.
  EXPECT_EQ(fast_blas_environment(r, {{"OMP_NUM_THREADS", "2"},
                                      {"OPENBLAS_CORETYPE", "Haswell"},
                                      {"OMP_WAIT_POLICY", "active"}}),
            (EnvMap{{"OPENBLAS_THREAD_TIMEOUT", "4"}, {"DDP_BLAS_CHOSEN", "wait"}}));
  // Nothing to change: nothing set.
  EXPECT_EQ(fast_blas_environment(openblas("Cooperlake", "Cooperlake"), {{"OMP_NUM_THREADS", "1"}}),
            EnvMap{});
  BlasReport ref;
  ref.vendor = "reference BLAS (netlib)";
  EXPECT_EQ(fast_blas_environment(ref, {{"OMP_NUM_THREADS", "4"}}), EnvMap{});
  BlasReport unknown;  // inspect_blas_apart's answer when its child failed
  unknown.vendor = "unknown";
  EXPECT_EQ(fast_blas_environment(unknown, {{"OMP_NUM_THREADS", "4"}}), EnvMap{});
}

// The child's report is the library's as this process then loads it (first, so that the child
// is not handed an already loaded one).
TEST(Blas, InspectedApartAsLoadedHere) {
  const BlasReport apart = inspect_blas_apart();
  const BlasReport here = inspect_blas();
  EXPECT_EQ(apart.vendor, here.vendor);
  EXPECT_EQ(apart.core, here.core);
  EXPECT_EQ(apart.threading, here.threading);
  EXPECT_EQ(apart.library, here.library);
  EXPECT_EQ(apart.cpu_best_core, here.cpu_best_core);
  EXPECT_EQ(apart.needs_core_override(), here.needs_core_override()) << here.summary();
}

TEST(Blas, InspectsTheLoadedLibrary) {
  BlasReport r = inspect_blas();
  // scripts/install-deps.sh installs OpenBLAS, which Debian's alternatives then prefer.
  EXPECT_EQ(r.vendor, "OpenBLAS") << r.summary();
  EXPECT_FALSE(r.core.empty());
  EXPECT_NE(r.library.find("openblas"), std::string::npos) << r.library;
  // Debian's default OpenBLAS (libopenblas0-pthread) runs pthreads of its own.
  EXPECT_EQ(r.threading, "pthreads") << r.summary();
  EXPECT_FALSE(r.summary().empty());
}

}  // namespace
}  // namespace ddp
