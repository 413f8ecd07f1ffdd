# Temporary per-phase timers for the background autosave (not committed to the sources).
import re
def edit(p, old, new):
    s = open(p).read(); assert s.count(old) == 1, (p, old); open(p, 'w').write(s.replace(old, new))
T = "std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - "
edit('lib/training/trainer.cc', """    LORASTEP_RETURN_IF_ERROR(add_all(trainable_all, &snapshot->trainable));
    LORASTEP_RETURN_IF_ERROR(add_all(optimizer_all, &snapshot->optimizer));""",
"""    auto tt0 = std::chrono::steady_clock::now();
    LORASTEP_RETURN_IF_ERROR(add_all(trainable_all, &snapshot->trainable));
    auto tt1 = std::chrono::steady_clock::now();
    LORASTEP_RETURN_IF_ERROR(add_all(optimizer_all, &snapshot->optimizer));
    LORASTEP_LOG(Info) << "TIMER snapshot trainable_ms " << std::chrono::duration<double, std::milli>(tt1 - tt0).count()
                       << " optimizer_ms " << """ + T + """tt1).count() << " n " << trainable_all.size() << " " << optimizer_all.size();""")
s = open('lib/training/trainer.cc').read()
if '#include "lib/log.h"' not in s:
    s = s.replace('#include "lib/status_macros.h"\n', '#include "lib/status_macros.h"\n#include "lib/log.h"\n', 1)
open('lib/training/trainer.cc', 'w').write(s)
edit('worker/worker_core.cc', """  if (background) {
    LORASTEP_ASSIGN_OR_RETURN(std::shared_ptr<const TrainerStateSnapshot> snapshot, t->SnapshotState());""",
"""  if (background) {
    auto st0 = std::chrono::steady_clock::now();
    LORASTEP_ASSIGN_OR_RETURN(std::shared_ptr<const TrainerStateSnapshot> snapshot, t->SnapshotState());
    LORASTEP_LOG(Info) << "TIMER SnapshotState_ms " << """ + T + """st0).count();""")
edit('worker/worker_core.cc', """      std::this_thread::sleep_for(delay);
      absl::Status s = AsReference(Trainer::WriteStateSnapshot(*snapshot, folder), folder, path);""",
"""      std::this_thread::sleep_for(delay);
      auto wt0 = std::chrono::steady_clock::now();
      absl::Status s = AsReference(Trainer::WriteStateSnapshot(*snapshot, folder), folder, path);
      LORASTEP_LOG(Info) << "TIMER write_ms " << """ + T + """wt0).count();""")
edit('worker/worker_core.cc', """  writer_.Await(ResolveRequestPath(store, absl::StrCat(kStateRefScheme, run_id, "/", name), "name").value_or(""));""",
"""  writer_.Await(ResolveRequestPath(store, absl::StrCat(kStateRefScheme, run_id, "/", name), "name").value_or(""));
  auto dt0 = std::chrono::steady_clock::now();
  absl::Status deleted = store->Delete(run_id, name);
  LORASTEP_LOG(Info) << "TIMER delete_ms " << """ + T + """dt0).count();
  return deleted;""")
edit('server/coordinator.cc', """  run.last_autosave_s = std::chrono::duration<double>(run.last_autosave_end - started).count();""",
"""  run.last_autosave_s = std::chrono::duration<double>(run.last_autosave_end - started).count();
  LORASTEP_LOG(Info) << "TIMER MaybeAutosave_ms " << run.last_autosave_s * 1e3 << " " << name;""")
edit('server/coordinator.cc', """    absl::Status written = writer->AwaitSaved(PathRequest(id, AutosaveRef(id, name)));""",
"""    auto ct0 = std::chrono::steady_clock::now();
    absl::Status written = writer->AwaitSaved(PathRequest(id, AutosaveRef(id, name)));
    LORASTEP_LOG(Info) << "TIMER await_ms " << """ + T + """ct0).count() << " " << name;""")
edit('server/coordinator.cc', """    // The steps since were not saved: save the run now, between its calls.""",
"""    LORASTEP_LOG(Info) << "TIMER catch_up " << name;
    // The steps since were not saved: save the run now, between its calls.""")
