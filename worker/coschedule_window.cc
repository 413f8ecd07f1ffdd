#include "worker/coschedule_window.h"

#include <algorithm>
#include <limits>
#include <set>

namespace lorastep {

RunReturns::Clock::time_point CoscheduleWindowClose(RunReturns::Clock::time_point opened,
                                                    RunReturns::Clock::duration window,
                                                    RunReturns::Clock::duration cap,
                                                    RunReturns::Clock::time_point latest,
                                                    const std::vector<const RunReturns*>& awaited) {
  RunReturns::Clock::time_point close = std::max(latest, opened) + window;
  for (const RunReturns* run : awaited) {
    if (!run->answered().has_value() || !run->turnaround().has_value() || *run->turnaround() > cap) continue;
    close = std::max(close, *run->answered() + 2 * *run->turnaround() + window);
  }
  return std::min(close, opened + cap);
}

StepShares ShareStep(const std::vector<WaitingCall>& waiting, const std::map<std::string, int64_t>& expected_tenants) {
  std::map<std::string, int64_t> first_call = expected_tenants;  // per active tenant
  for (auto it = waiting.rbegin(); it != waiting.rend(); ++it) first_call[it->tenant] = it->tokens;
  StepShares shares;
  shares.active_tenants = first_call.size();
  int64_t quantum = std::numeric_limits<int64_t>::max();
  if (first_call.size() > 1) {
    quantum = 0;
    for (const auto& [tenant, tokens] : first_call) quantum = std::max(quantum, tokens);
  }
  std::set<std::string> runs;
  std::map<std::string, int64_t> taken_tokens;
  for (size_t i = 0; i < waiting.size(); ++i) {
    const WaitingCall& c = waiting[i];
    if (runs.count(c.run)) continue;  // a run's next call waits for the next step
    auto tenant = taken_tokens.find(c.tenant);
    if (tenant != taken_tokens.end() && tenant->second + c.tokens > quantum) {
      shares.heavy.insert(c.tenant);
      continue;
    }
    runs.insert(c.run);
    taken_tokens[c.tenant] += c.tokens;
    shares.within.push_back(i);
    shares.tenants_of_within.insert(c.tenant);
  }
  return shares;
}

StepChoice TakeForStep(const std::vector<WaitingCall>& waiting, const StepShares& shares, bool last_step_heavy) {
  const bool light_waiting = shares.tenants_of_within.size() > shares.heavy.size();
  StepChoice choice;
  choice.heavy = !shares.heavy.empty();
  const bool turns = !shares.heavy.empty() && light_waiting;
  for (size_t i : shares.within) {
    if (turns && (shares.heavy.count(waiting[i].tenant) != 0) == last_step_heavy) continue;
    choice.taken.push_back(i);
  }
  if (turns) choice.heavy = !last_step_heavy;
  return choice;
}

std::vector<std::string> RunsToAwait(const std::vector<WaitingCall>& waiting, const StepShares& shares,
                                     const std::set<std::string>& expected,
                                     const std::function<std::string(const std::string&)>& tenant_of) {
  if (!shares.heavy.empty()) return {};
  std::set<std::string> runs, tenants;
  for (const WaitingCall& c : waiting) {
    runs.insert(c.run);
    tenants.insert(c.tenant);
  }
  std::vector<std::string> awaited;
  for (const std::string& run : expected) {
    if (runs.count(run) || (shares.active_tenants > 1 && tenants.count(tenant_of(run)))) continue;
    awaited.push_back(run);
  }
  return awaited;
}

}  // namespace lorastep
