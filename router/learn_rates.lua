-- One worker's learned rates after one first token: router/rates.py's `observe`, inside Redis,
-- so every router replica's releases update the one fit each worker has, and a new replica
-- reads what the others learned (tests/router/test_rates.py holds the two to the same numbers).
-- A library: release.lua is prepended with it and calls learn_rate at a first token's release.
-- learn_rate(rates_key, worker, work, ttft, a, max_step):
--   rates_key: the model's rates hash (field: worker id, value: schemas/rates.py's FIT_LAYOUT);
--   work: {compute, host-load, L3-load tokens the decision predicted}; ttft: the first
--   token's seconds; a: router/rates.py `fit_arguments`: 1-3 the prior's tokens/s of each
--   kind, 4 forgetting, 5 outlier errors, 6 error memory, 7 warmup, 8 lowest multiplier,
--   9 highest multiplier, 10 max uncertainty, 11 kinds correlated, 12 change after, 13 the
--   first token's floor (s).
-- Returns the worker's fit after the sample, encoded (unchanged when the sample says nothing),
-- and, when the sample taught, what the fit predicted for the work before it and the first
-- token's time at the floor (for track_error).
-- track_error(errors_key, worker, predicted, ttft, memory): router/rates.py `track_error` on
--   the worker's PredictionError (schemas/rates.py ERROR_LAYOUT) in the model's errors hash.
-- schemas/rates.py FIT_LAYOUT: 15 little-endian doubles (multipliers, covariance, mean error,
-- samples, streak); exact, and far cheaper than writing and parsing 17-digit decimals.
local FIT_LAYOUT = '<ddddddddddddddd'
local function encode_fit(v)
  return struct.pack(FIT_LAYOUT, v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10], v[11], v[12],
                     v[13], v[14], v[15])
end

-- max_step: the most one sample may move a multiplier, relative to it (0: no bound): a sample
-- a client reported (router/rates.py ClientSamples), not one the router timed.
local function learn_rate(rates_key, worker, work, ttft, a, max_step)
  local forgetting, outliers, memory_w = tonumber(a[4]), tonumber(a[5]), tonumber(a[6])
  local warmup, low, high = tonumber(a[7]), tonumber(a[8]), tonumber(a[9])
  local max_uncertainty, rho, change_after = tonumber(a[10]), tonumber(a[11]), tonumber(a[12])

  local held = redis.call('HGET', rates_key, worker)
  local f
  if held and #held == 120 then
    f = {struct.unpack(FIT_LAYOUT, held)}
  else  -- the first fit (or one not in this layout): the prior's rates, unsure by one, the kinds correlated by rho
    held = nil
    f = {1.0, 1.0, 1.0, 1.0, rho, rho, rho, 1.0, rho, rho, rho, 1.0, 0.0, 0, 0}
  end

  local nominal = {work[1] * (1 / tonumber(a[1])), work[2] * (1 / tonumber(a[2])),
                   work[3] * (1 / tonumber(a[3]))}
  -- (ttft > 0 is false for NaN too: a time that is not positive says nothing)
  if not (ttft > 0) or not (nominal[1] > 0 or nominal[2] > 0 or nominal[3] > 0) then
    return held or encode_fit(f), nil, nil
  end
  ttft = math.max(ttft, tonumber(a[13]))  -- under the clocks' resolution: the floor
  local theta = {f[1], f[2], f[3]}
  local p = {f[4], f[5], f[6], f[7], f[8], f[9], f[10], f[11], f[12]}
  local err_s, samples, streak_was = f[13], f[14], f[15]
  -- relative to the prediction: every request teaches as much, whatever its size
  local predicted = ((0 + theta[1] * nominal[1]) + theta[2] * nominal[2]) + theta[3] * nominal[3]
  local x = {nominal[1] / predicted, nominal[2] / predicted, nominal[3] / predicted}
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
        p = {1.0, rho, rho, rho, 1.0, rho, rho, rho, 1.0}
      end
    end
  end
  local px = {}
  for i = 0, 2 do
    px[i + 1] = (p[3 * i + 1] * x[1] + p[3 * i + 2] * x[2]) + p[3 * i + 3] * x[3]
  end
  local denominator = ((forgetting + x[1] * px[1]) + x[2] * px[2]) + x[3] * px[3]
  local gain = {px[1] / denominator, px[2] / denominator, px[3] / denominator}
  local out = {}
  for i = 1, 3 do
    local m = theta[i] + gain[i] * err
    if max_step > 0 then m = math.min(math.max(m, theta[i] * (1 - max_step)), theta[i] * (1 + max_step)) end
    out[i] = math.min(math.max(m, low), high)
  end
  for i = 0, 2 do
    for j = 0, 2 do
      out[4 + 3 * i + j] = (p[3 * i + j + 1] - gain[i + 1] * px[j + 1]) / forgetting
    end
  end
  local trace = (out[4] + out[8]) + out[12]
  if trace > max_uncertainty then
    for k = 4, 12 do out[k] = out[k] * max_uncertainty / trace end
  end
  -- the mean of the first errors, then the recent ones' (rates.py observe)
  local memory = math.max(memory_w, 1.0 / (samples + 1))
  out[13] = (1 - memory) * err_s + memory * math.abs(err)
  out[14] = samples + 1
  out[15] = streak
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
