#include "server/mesh_executor.h"

#include <algorithm>
#include <condition_variable>
#include <limits>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"

namespace lorastep {
namespace {

// A mesh rank's failure that only reflects a peer's: ABORTED by the outcome vote, a
// collective that timed out or broke waiting for another rank.
bool IsPeerFailure(const absl::Status& s) {
  return absl::IsAborted(s) || absl::IsDeadlineExceeded(s) ||
         (absl::IsUnavailable(s) && s.message().find(" group ") != absl::string_view::npos);
}

// A mesh generation names the store keys its communicators rendezvous under, so it must be
// one no rank has used: random rather than counted, so that a restarted coordinator (which
// forgot its count) never sends ranks that outlived it back to keys their earlier
// generations left behind. Workers only compare it for equality.
int64_t NewMeshGeneration(int64_t current) {
  static std::mutex mu;
  static std::mt19937 rng(std::random_device{}());
  std::lock_guard<std::mutex> lock(mu);
  int64_t next = current;
  while (next == current) next = std::uniform_int_distribution<int32_t>(0, std::numeric_limits<int32_t>::max())(rng);
  return next;
}

}  // namespace

MeshExecutor::MeshExecutor(WorkerPool* pool, std::chrono::seconds peer_failure_grace, bool mesh_by_registration)
    : pool_(pool),
      peer_failure_grace_(peer_failure_grace),
      mesh_by_registration_(mesh_by_registration),
      mesh_generation_(NewMeshGeneration(-1)) {}

void MeshExecutor::StampMesh(v1::MeshCall* mesh) {
  mesh->set_mesh_generation(mesh_generation_);
  if (mesh_by_registration_) mesh->set_rendezvous(pool_->rendezvous());
}

absl::Status MeshExecutor::Run(const std::vector<WorkerRef>& workers, const std::vector<int>& ranks,
                               const std::function<absl::Status(size_t i, WorkerClient*)>& call) {
  const bool on_mesh = pool_->on_mesh();
  std::unique_lock<FairMutex> mesh_lock(mesh_mu_, std::defer_lock);
  if (on_mesh) mesh_lock.lock();
  if (on_mesh && pool_->TakeRegenerate()) mesh_generation_ = NewMeshGeneration(mesh_generation_);
  // A run on a worker known to be down fails at once, and never reaches a process that has
  // since taken the dead one's address.
  for (int r : ranks) {
    if (workers[r]->down) {
      return absl::UnavailableError(
          absl::StrCat("worker ", (*workers[r])->address(), " is down: ", pool_->WhatHappensToDownRuns()));
    }
  }
  std::vector<absl::Status> results(ranks.size(), absl::UnknownError("not run"));
  std::vector<bool> cancelled(ranks.size(), false);
  int root_rank = -1;
  if (ranks.size() == 1) {
    results[0] = call(0, workers[ranks[0]]->client.get());
  } else {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<bool> finished(ranks.size(), false);
    size_t done = 0;
    std::vector<std::thread> threads;
    for (size_t i = 0; i < ranks.size(); ++i) {
      threads.emplace_back([&, i] {
        absl::Status r = call(i, workers[ranks[i]]->client.get());
        std::lock_guard<std::mutex> lock(mu);
        results[i] = std::move(r);
        finished[i] = true;
        ++done;
        cv.notify_all();
      });
    }
    // A rank that failed only because a peer did (its collective timed out waiting) starts
    // the grace too: the peer it waited for may be stopped or wedged and never answer.
    {
      std::unique_lock<std::mutex> lock(mu);
      std::chrono::steady_clock::time_point deadline;
      while (done < ranks.size()) {
        if (root_rank < 0) {
          for (size_t i = 0; i < ranks.size(); ++i) {
            if (!finished[i] || results[i].ok()) continue;
            // A rank that failed on its own names the failure; else the first that failed.
            if (root_rank < 0 || !IsPeerFailure(results[i])) root_rank = ranks[i];
            if (!IsPeerFailure(results[i])) break;
          }
          if (root_rank < 0) {
            cv.wait(lock);
            continue;
          }
          deadline = std::chrono::steady_clock::now() + peer_failure_grace_;
        }
        if (cv.wait_until(lock, deadline) == std::cv_status::timeout && done < ranks.size()) {
          for (size_t i = 0; i < ranks.size(); ++i) {
            if (finished[i]) continue;
            cancelled[i] = true;
            (*workers[ranks[i]])->CancelInFlight();
          }
          break;
        }
      }
    }
    for (auto& t : threads) t.join();
  }
  absl::Status verdict = Verdict(workers, ranks, results, cancelled, root_rank);
  // Communicators may be broken: every rank rebuilds at the next call.
  if (!verdict.ok() && on_mesh) mesh_generation_ = NewMeshGeneration(mesh_generation_);
  return verdict;
}

absl::Status MeshExecutor::Verdict(const std::vector<WorkerRef>& workers, const std::vector<int>& ranks,
                                   std::vector<absl::Status>& results, const std::vector<bool>& cancelled,
                                   int root_rank) {
  const bool root_waited = root_rank >= 0 && [&] {
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (ranks[i] == root_rank) return IsPeerFailure(results[i]);
    }
    return false;
  }();
  std::set<int> unanswered;  // ranks cancelled after a peer's collective timed out waiting for them
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (!cancelled[i] || results[i].ok()) continue;
    results[i] = absl::DeadlineExceededError(absl::StrCat(
        "no answer ", peer_failure_grace_.count(), " s after rank ", root_rank,
        root_waited ? "'s collective timed out waiting for its peers; call cancelled (this worker is stopped, "
                      "wedged or unreachable)"
                    : " failed; call cancelled (the worker may still be blocked in a collective)"));
    // The rank that never answered is the cause when the first failure only waited for it.
    if (root_waited) unanswered.insert(ranks[i]);
  }
  // A call that failed at the transport (the worker process is gone) marks its worker down;
  // a call cancelled by us, or one that failed inside a collective, does not.
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (!results[i].ok() && absl::IsUnavailable(results[i]) && !IsPeerFailure(results[i])) {
      PooledWorker* w = workers[ranks[i]].get();
      pool_->MarkDown(w, results[i]);
      results[i] = absl::UnavailableError(absl::StrCat(results[i].message(), " (worker ", (*w)->address(),
                                                       " is down: ", pool_->WhatHappensToDownRuns(), ")"));
    }
  }
  // Root causes first: a rank that failed on its own, before those that only saw a peer
  // fail (ABORTED by the outcome vote, a collective that timed out waiting for it, a call
  // cancelled after the grace).
  std::vector<std::pair<int, absl::Status>> failed;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (!results[i].ok()) failed.push_back({ranks[i], results[i]});
  }
  if (failed.empty()) return absl::OkStatus();
  auto cause = [&](const std::pair<int, absl::Status>& f) {
    return unanswered.count(f.first) > 0 || !IsPeerFailure(f.second);
  };
  std::stable_sort(failed.begin(), failed.end(), [&](const auto& a, const auto& b) { return cause(a) && !cause(b); });
  if (!pool_->on_mesh()) return failed[0].second;
  // DATA_LOSS: a rank failed after the commit vote, when the others had applied the step.
  const bool applied_elsewhere = std::any_of(failed.begin(), failed.end(), [](const auto& f) {
    return absl::IsDataLoss(f.second);
  });
  std::string msg;
  for (const auto& [rank, status] : failed) {
    const RankCoords c = pool_->layout().Coords(rank);
    absl::StrAppend(&msg, msg.empty() ? "" : "; ", "rank ", rank, " (tp", c.tp, " pp", c.pp, " dp", c.dp,
                    pool_->layout().sizes().cp > 1 ? absl::StrCat(" cp", c.cp) : "", ", ",
                    (*workers[rank])->address(), "): ", status.message());
  }
  if (applied_elsewhere) {
    return absl::DataLossError(absl::StrCat(failed.size(), " of ", ranks.size(),
                                            " ranks failed after the commit vote; the others applied the step: ", msg));
  }
  return absl::Status(failed[0].second.code(), absl::StrCat(failed.size(), " of ", ranks.size(),
                                                            " ranks failed; nothing was applied: ", msg));
}

}  // namespace lorastep
