-- One worker's learned rates after one first token: router/rates.py's `observe`, inside Redis,
-- so every router replica's releases update the one fit each worker has, and a new replica
-- reads what the others learned (tests/router/test_rates.py holds the two to the same numbers).
-- A library: release.lua is prepended with it and calls learn_rate at a first token's release.
-- learn_rate(rates_key, worker, work, ttft, a, max_step):
--   rates_key: the model's rates hash (field: worker id, value: schemas/rates.py's FIT_LAYOUT);
--   work: {compute, host-load, L3-load, queued tokens the decision predicted} (schemas/rates.py
--   WORK_KINDS; a booking from before the queued kind has 3: none queued); ttft: the first
--   token's seconds; a: router/rates.py `fit_arguments`: 1-3 the prior's tokens/s of each
--   kind (the queued kind at the compute rate), 4 forgetting, 5 outlier errors, 6 error memory,
--   7 warmup, 8 lowest multiplier, 9 highest multiplier, 10 max uncertainty, 11 kinds
--   correlated, 12 change after, 13 the first token's floor (s).
-- Returns the worker's fit after the sample, encoded (unchanged when the sample says nothing),
-- and, when the sample taught, what the fit predicted for the work before it and the first
-- token's time at the floor (for track_error).
-- track_error(errors_key, worker, predicted, ttft, memory): router/rates.py `track_error` on
--   the worker's PredictionError (schemas/rates.py ERROR_LAYOUT) in the model's errors hash.
-- Every sum runs left to right from 0, as router/rates.py's `_dot`, so both give the same doubles.
local K = 4  -- kinds of work
-- schemas/rates.py FIT_LAYOUT: 23 little-endian doubles (multipliers, covariance, mean error,
-- samples, streak); exact, and far cheaper than writing and parsing 17-digit decimals.
local FIT_LAYOUT = '<' .. string.rep('d', K + K * K + 3)
local FIT_BYTES = 8 * (K + K * K + 3)
local function encode_fit(v)
  return struct.pack(FIT_LAYOUT, unpack(v, 1, K + K * K + 3))
end

-- the first fit's covariance: unsure by one, the kinds correlated by rho
local function first_covariance(rho)
  local p = {}
  for i = 0, K - 1 do
    for j = 0, K - 1 do
      if i == j then p[K * i + j + 1] = 1.0 else p[K * i + j + 1] = rho end
    end
  end
  return p
end

-- max_step: the most one sample may move a multiplier, relative to it (0: no bound): a sample
-- a client reported (router/rates.py ClientSamples), not one the router timed.
local function learn_rate(rates_key, worker, work, ttft, a, max_step)
  local forgetting, outliers, memory_w = tonumber(a[4]), tonumber(a[5]), tonumber(a[6])
  local warmup, low, high = tonumber(a[7]), tonumber(a[8]), tonumber(a[9])
  local max_uncertainty, rho, change_after = tonumber(a[10]), tonumber(a[11]), tonumber(a[12])

  local held = redis.call('HGET', rates_key, worker)
  local theta, p, err_s, samples, streak_was
  if held and #held == FIT_BYTES then
    local f = {struct.unpack(FIT_LAYOUT, held)}
    theta, p = {unpack(f, 1, K)}, {unpack(f, K + 1, K + K * K)}
    err_s, samples, streak_was = f[K + K * K + 1], f[K + K * K + 2], f[K + K * K + 3]
  else  -- the first fit (or one not in this layout): the prior's rates
    held = nil
    theta, p, err_s, samples, streak_was = {1.0, 1.0, 1.0, 1.0}, first_covariance(rho), 0.0, 0, 0
  end

  local compute_s = 1 / tonumber(a[1])
  local nominal = {work[1] * compute_s, work[2] * (1 / tonumber(a[2])), work[3] * (1 / tonumber(a[3])),
                   (work[4] or 0) * compute_s}
  -- (ttft > 0 is false for NaN too: a time that is not positive says nothing)
  if not (ttft > 0) or not (nominal[1] > 0 or nominal[2] > 0 or nominal[3] > 0 or nominal[4] > 0) then
    if held then return held, nil, nil end
    local first = {unpack(theta)}
    for k = 1, K * K do first[K + k] = p[k] end
    first[K + K * K + 1], first[K + K * K + 2], first[K + K * K + 3] = err_s, samples, streak_was
    return encode_fit(first), nil, nil
  end
  ttft = math.max(ttft, tonumber(a[13]))  -- under the clocks' resolution: the floor
  -- relative to the prediction: every request teaches as much, whatever its size
  local predicted = 0
  for i = 1, K do predicted = predicted + theta[i] * nominal[i] end
  local x = {}
  for i = 1, K do x[i] = nominal[i] / predicted end
  local err = ttft / predicted - 1.0
  local streak = 0
  if samples >= warmup and err_s > 0 then
    local bound = outliers * err_s
    if math.abs(err) > bound then
      -- beyond the bound again, the same way: a run of them is a change, not an outlier
      if err * streak_was > 0 then streak = streak_was + 1 elseif err > 0 then streak = 1 else streak = -1 end
      if math.abs(streak) < change_after then
        err = math.min(math.max(err, -bound), bound)
      elseif math.abs(streak) == change_after then  -- the worker changed: as unsure as at the start
        p = first_covariance(rho)
      end
    end
  end
  local px, xpx = {}, 0
  for i = 0, K - 1 do
    local v = 0
    for j = 1, K do v = v + p[K * i + j] * x[j] end
    px[i + 1] = v
  end
  for i = 1, K do xpx = xpx + x[i] * px[i] end
  local denominator = forgetting + xpx
  local gain = {}
  for i = 1, K do gain[i] = px[i] / denominator end
  local out = {}
  for i = 1, K do
    local m = theta[i] + gain[i] * err
    if max_step > 0 then m = math.min(math.max(m, theta[i] * (1 - max_step)), theta[i] * (1 + max_step)) end
    out[i] = math.min(math.max(m, low), high)
  end
  for i = 0, K - 1 do
    for j = 0, K - 1 do
      out[K + 1 + K * i + j] = (p[K * i + j + 1] - gain[i + 1] * px[j + 1]) / forgetting
    end
  end
  local trace = 0
  for i = 0, K - 1 do trace = trace + out[K + 1 + (K + 1) * i] end
  if trace > max_uncertainty then
    for k = K + 1, K + K * K do out[k] = out[k] * max_uncertainty / trace end
  end
  -- the mean of the first errors, then the recent ones' (rates.py observe)
  local memory = math.max(memory_w, 1.0 / (samples + 1))
  out[K + K * K + 1] = (1 - memory) * err_s + memory * math.abs(err)
  out[K + K * K + 2] = samples + 1
  out[K + K * K + 3] = streak
  local encoded = encode_fit(out)
  redis.call('HSET', rates_key, worker, encoded)
  return encoded, predicted, ttft
end

local ERROR_LAYOUT = '<ddd'
local function track_error(errors_key, worker, predicted, ttft, memory)
  local held = redis.call('HGET', errors_key, worker)
  local samples, mape, bias = 0, 0.0, 0.0
  if held and #held == 24 then samples, mape, bias = struct.unpack(ERROR_LAYOUT, held) end
  local off = (predicted - ttft) / ttft
  local weight = math.max(memory, 1.0 / (samples + 1))
  mape = (1 - weight) * mape + weight * math.abs(off)
  bias = (1 - weight) * bias + weight * off
  redis.call('HSET', errors_key, worker, struct.pack(ERROR_LAYOUT, samples + 1, mape, bias))
  return off
end
