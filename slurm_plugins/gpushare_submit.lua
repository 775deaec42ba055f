-- slurm-gpushare job_submit module (Lua 5.1-5.4), written by `gpushare slurm-config --install-lua DIR` as
-- gpushare_submit.lua next to slurm.conf. A site's own job_submit.lua loads it with two lines (printed by
-- `gpushare slurm-config`) and calls gpushare.job_submit(job_desc, part_list, submit_uid) from its own
-- slurm_job_submit, so the site keeps its rules and we keep ours; M.job_submit returns slurm.SUCCESS or
-- the service's rejection code.
--
-- Thin on purpose: it forwards GPU jobs to gpushare-submitd over a unix socket and applies the reply.
-- slurmctld holds its job write lock while this runs, so every path is bounded by DEADLINE_S, and every
-- failure (no lua-socket, service down, hung, garbage, a bug here) accepts the job unchanged and logs it.
-- It never sets job_desc.extra (slurmctld 22.05 can abort when a job with `extra` set is rejected) and
-- never rejects root's jobs.

local M = {}

local SOCKET_PATH = "@SOCKET_PATH@"
local DEADLINE_S = @DEADLINE_S@
local MAX_SCRIPT_BYTES = @MAX_SCRIPT_BYTES@
local SHARED_FEATURE = "@SHARED_FEATURE@" -- node feature shared jobs need; empty: no withholding
-- Circuit breaker: after BREAKER_TIMEOUTS deadlines in a row the service is skipped (jobs accepted
-- unchanged at once) for BREAKER_OPEN_S, then tried again. Why: a hung or overloaded service would
-- otherwise cost every GPU job the full deadline while slurmctld holds its job write lock. The state
-- lives in this Lua state, which slurmctld keeps between calls.
local BREAKER_TIMEOUTS = @BREAKER_TIMEOUTS@
local BREAKER_OPEN_S = @BREAKER_OPEN_S@
local timeouts_in_a_row = 0
local skip_until = 0

local have_socket, socket = pcall(require, "socket")
local have_unix, unix = pcall(require, "socket.unix")

local function escape(text)
	return (string.gsub(text, '[%z\1-\31"\\\127-\255]', function(c)
		return string.format("\\u%04x", string.byte(c))
	end))
end

local function json_string(value)
	if value == nil then
		return "null"
	end
	return '"' .. escape(tostring(value)) .. '"'
end

local function json_number(value)
	if type(value) ~= "number" then
		return "null"
	end
	return string.format("%d", value)
end

local function mentions_gpu(value)
	if type(value) ~= "string" then
		return false
	end
	return string.find(value, "gpu", 1, true) ~= nil
		or string.find(value, "shard", 1, true) ~= nil
		or string.find(value, "mps", 1, true) ~= nil
end

local function timed_out(err)
	timeouts_in_a_row = timeouts_in_a_row + 1
	if timeouts_in_a_row >= BREAKER_TIMEOUTS then
		skip_until = socket.gettime() + BREAKER_OPEN_S
		slurm.log_error("gpushare: %d submit service timeouts in a row; skipping it for %d s", timeouts_in_a_row,
			BREAKER_OPEN_S)
	end
	return nil, err
end

local function ask_service(request)
	local new_stream = unix.stream or unix
	local conn = new_stream()
	local deadline = socket.gettime() + DEADLINE_S
	conn:settimeout(DEADLINE_S)
	local ok, err = conn:connect(SOCKET_PATH)
	if not ok then
		conn:close()
		if err == "timeout" then
			return timed_out("connect " .. SOCKET_PATH .. ": timeout")
		end
		return nil, "connect " .. SOCKET_PATH .. ": " .. tostring(err)
	end
	ok, err = conn:send(request)
	if not ok then
		conn:close()
		if err == "timeout" then
			return timed_out("send: timeout")
		end
		return nil, "send: " .. tostring(err)
	end
	local reply = {}
	while true do
		local left = deadline - socket.gettime()
		if left <= 0 then
			conn:close()
			return timed_out("no complete reply within the deadline")
		end
		conn:settimeout(left)
		local line, receive_err = conn:receive("*l")
		if not line then
			conn:close()
			if receive_err == "timeout" then
				return timed_out("receive: timeout")
			end
			return nil, "receive: " .. tostring(receive_err)
		end
		if line == "end" then
			break
		end
		local key, value = string.match(line, "^([%w_]+)=(.*)$")
		if not key then
			conn:close()
			return nil, "garbage reply"
		end
		reply[key] = value
	end
	conn:close()
	timeouts_in_a_row = 0
	return reply
end

local function ask(request)
	if not (have_socket and have_unix) then
		return nil, "lua-socket is not installed"
	end
	local now = socket.gettime()
	if now < skip_until then
		return nil, string.format("service skipped for %.0f s more after %d timeouts in a row", skip_until - now,
			timeouts_in_a_row)
	end
	return ask_service(request)
end

-- A job we made shared must land on a node whose agent keeps SHARED_FEATURE active (docs/agent.md):
-- a node with a risky or warming GPU drops it and receives no new shared job until calm. Constraints
-- with counts, brackets, parentheses or OR are left as they are rather than risk a rejected job.
local function add_shared_feature(job_desc)
	if SHARED_FEATURE == "" or string.find(SHARED_FEATURE, "[^%w_]") then -- unset, or never rendered
		return
	end
	local current = job_desc.features
	if current == nil or current == "" then
		job_desc.features = SHARED_FEATURE
	elseif string.find(current, "[%[%]%*%(%)|]") then
		slurm.log_info("gpushare: constraint %s kept as is; busy nodes are not withheld for this job", current)
	elseif not string.find("&" .. current .. "&", "&" .. SHARED_FEATURE .. "&", 1, true) then
		job_desc.features = current .. "&" .. SHARED_FEATURE
	end
end

-- The default partition's name, for a job that names none: sharing is scoped per partition
-- ([policy] partitions) and a job sent to the default one must be judged by it. part_list holds the
-- partitions the user may use, each with flag_default; nil when none is marked (the service then decides).
local function default_partition(job_desc, part_list)
	if job_desc.partition ~= nil or type(part_list) ~= "table" then
		return nil
	end
	for _, part in pairs(part_list) do
		local flag = part.flag_default
		if flag ~= nil and flag ~= 0 and flag ~= false then
			return part.name
		end
	end
	return nil
end

local function submit(job_desc, part_list, submit_uid)
	if not (mentions_gpu(job_desc.tres_per_node) or mentions_gpu(job_desc.tres_per_job)
		or mentions_gpu(job_desc.tres_per_task)) then
		return slurm.SUCCESS
	end
	local script = job_desc.script or ""
	if string.len(script) > MAX_SCRIPT_BYTES then
		script = string.sub(script, 1, MAX_SCRIPT_BYTES)
	end
	local request = "{" .. table.concat({
		'"op":"submit"',
		'"user_id":' .. json_number(submit_uid),
		'"name":' .. json_string(job_desc.name),
		'"tres_per_node":' .. json_string(job_desc.tres_per_node),
		'"tres_per_job":' .. json_string(job_desc.tres_per_job),
		'"tres_per_task":' .. json_string(job_desc.tres_per_task),
		'"min_nodes":' .. json_number(job_desc.min_nodes),
		'"partition":' .. json_string(job_desc.partition),
		'"default_partition":' .. json_string(default_partition(job_desc, part_list)),
		'"account":' .. json_string(job_desc.account),
		'"qos":' .. json_string(job_desc.qos),
		'"array_inx":' .. json_string(job_desc.array_inx),
		'"het_job_offset":' .. json_number(job_desc.het_job_offset),
		'"work_dir":' .. json_string(job_desc.work_dir),
		'"script":' .. json_string(script),
	}, ",") .. "}\n"
	local reply, err = ask(request)
	if not reply then
		slurm.log_error("gpushare: job of uid %s accepted unchanged: %s", tostring(submit_uid), tostring(err))
		return slurm.SUCCESS
	end
	if reply.action == "reject" then
		if submit_uid == 0 then
			slurm.log_info("gpushare: not rejecting root's job: %s", tostring(reply.reject_msg))
			return slurm.SUCCESS
		end
		slurm.log_user("%s", reply.reject_msg or "gpushare: job rejected")
		return slurm.ESLURM_INVALID_GRES or slurm.ERROR
	end
	if reply.action == "modify" and reply.tres_per_node and reply.tres_per_node ~= "" then
		job_desc.tres_per_node = reply.tres_per_node
	end
	if reply.action == "modify" and reply.hold == "1" then
		job_desc.priority = 0 -- held until its asynchronous estimate lands; gpushare-submitd releases it
	end
	if reply.admin_comment and reply.admin_comment ~= "" then
		job_desc.admin_comment = reply.admin_comment
	end
	if reply.user_msg and reply.user_msg ~= "" then
		slurm.log_user("%s", reply.user_msg)
	end
	if reply.action == "modify" and reply.tres_per_node and string.find(reply.tres_per_node, "shard", 1, true) then
		add_shared_feature(job_desc)
	end
	return slurm.SUCCESS
end

-- The entry point a site's slurm_job_submit calls. Never raises: a Lua error here is logged and the job
-- accepted unchanged, so the site's own rules around this call keep running.
function M.job_submit(job_desc, part_list, submit_uid)
	local ok, result = pcall(submit, job_desc, part_list, submit_uid)
	if not ok then
		slurm.log_error("gpushare: hook error, job accepted unchanged: %s", tostring(result))
		return slurm.SUCCESS
	end
	return result
end

-- Updates pass through untouched: Slurm itself refuses gpu<->shard changes on pending jobs, and an
-- admin's `scontrol update` (including our own OOM recovery) must never be second-guessed here.
function M.job_modify(job_desc, job_rec, part_list, modify_uid)
	return slurm.SUCCESS
end

return M
