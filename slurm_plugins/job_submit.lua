-- slurm-gpushare job_submit.lua for a site without one of its own, written by
-- `gpushare slurm-config --install-lua DIR` only where DIR holds no job_submit.lua yet.
--
-- All the work is in the module gpushare_submit.lua beside it. A site that already has a job_submit.lua
-- keeps it and adds the two lines below to it (the `require` at the top, the call inside its own
-- slurm_job_submit), which `gpushare slurm-config` prints. slurmctld reloads this file when its
-- modification time changes, and the module with it: touch this file after updating the module.

@LOADER@

function slurm_job_submit(job_desc, part_list, submit_uid)
	return gpushare.job_submit(job_desc, part_list, submit_uid)
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
	return gpushare.job_modify(job_desc, job_rec, part_list, modify_uid)
end

return slurm.SUCCESS
