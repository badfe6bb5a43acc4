package main

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// How the harness counts Redis work. Before each measured section it runs CONFIG
// RESETSTAT; after it, one INFO call reads total_commands_processed and
// commandstats together. Redis 7 counts a command a script runs both in
// total_commands_processed and under its own name in commandstats (EVALSHA counts
// once more for itself), so:
//
//   - server commands = every call in commandstats, less the harness's own
//     (INFO, CONFIG RESETSTAT) and connection handshakes;
//   - requests (what clients sent; a script call counts once) = server commands
//     less the commands that contender runs only inside its scripts
//     (contenderKind.scriptOnly).
//
// Connection handshakes (HELLO, CLIENT SETINFO/TRACKING, AUTH, SELECT) are counted
// apart: they depend on when a pool decides to dial, not on locking.

// harnessCommands are the commands the harness itself sends to read statistics.
var harnessCommands = map[string]bool{"info": true, "config|resetstat": true}

// handshakeCommands are sent once per new connection.
var handshakeCommands = map[string]bool{
	"hello": true, "client|setinfo": true, "client|tracking": true,
	"client|setname": true, "auth": true, "select": true,
}

// RedisWork is what the server did during one measured section.
type RedisWork struct {
	// Requests counts the commands clients sent; a script call counts once.
	Requests int64 `json:"requests"`
	// Commands counts every command the server ran, those inside scripts included.
	Commands int64 `json:"server_commands"`
	// Handshakes counts connection set-up commands (left out of both above).
	Handshakes int64 `json:"handshakes"`
	// TotalProcessed is INFO's total_commands_processed, less the harness's calls.
	TotalProcessed int64 `json:"total_commands_processed"`
	// ByCommand is every commandstats entry, the harness's left out.
	ByCommand map[string]int64 `json:"by_command"`
}

// redisStats reads and resets a server's statistics over its own connection.
type redisStats struct {
	rdb *redis.Client
}

// newRedisStats connects a one-connection client for statistics to addr.
func newRedisStats(ctx context.Context, addr string) (*redisStats, error) {
	rdb := redis.NewClient(&redis.Options{Addr: addr, PoolSize: 1, MinIdleConns: 0})
	if err := rdb.Ping(ctx).Err(); err != nil {
		rdb.Close()
		return nil, fmt.Errorf("no Redis at %s: %w", addr, err)
	}
	return &redisStats{rdb: rdb}, nil
}

// close closes the statistics connection.
func (s *redisStats) close() error { return s.rdb.Close() }

// reset zeroes the server's statistics (CONFIG RESETSTAT).
func (s *redisStats) reset(ctx context.Context) error {
	return s.rdb.ConfigResetStat(ctx).Err()
}

// work returns the Redis work since the last reset, splitting off the commands that
// kind runs only inside its scripts.
func (s *redisStats) work(ctx context.Context, scriptOnly []string) (RedisWork, error) {
	text, err := s.rdb.Info(ctx, "stats", "commandstats").Result()
	if err != nil {
		return RedisWork{}, err
	}
	total, calls, err := parseInfo(text)
	if err != nil {
		return RedisWork{}, err
	}
	return splitWork(total, calls, scriptOnly), nil
}

// addShared counts n more requests: commands a client sent outside its scripts
// that splitWork took for script-only ones (see sharedCounter).
func (w *RedisWork) addShared(n int64) { w.Requests += n }

// splitWork turns raw counters into RedisWork (see the comment at the top).
func splitWork(total int64, calls map[string]int64, scriptOnly []string) RedisWork {
	inScript := map[string]bool{}
	for _, c := range scriptOnly {
		inScript[c] = true
	}
	w := RedisWork{ByCommand: map[string]int64{}, TotalProcessed: total}
	for cmd, n := range calls {
		switch {
		case harnessCommands[cmd]:
			w.TotalProcessed -= n
			continue
		case handshakeCommands[cmd]:
			w.Handshakes += n
		case inScript[cmd]:
			w.Commands += n
		default:
			w.Commands += n
			w.Requests += n
		}
		w.ByCommand[cmd] = n
	}
	return w
}

// parseInfo reads total_commands_processed and the calls of every commandstats
// entry ("cmdstat_evalsha:calls=12,usec=...") from INFO's text.
func parseInfo(text string) (total int64, calls map[string]int64, err error) {
	calls = map[string]int64{}
	total = -1
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		key, val, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		switch {
		case key == "total_commands_processed":
			if total, err = strconv.ParseInt(val, 10, 64); err != nil {
				return 0, nil, fmt.Errorf("INFO %s: %w", line, err)
			}
		case strings.HasPrefix(key, "cmdstat_"):
			for _, field := range strings.Split(val, ",") {
				if n, ok := strings.CutPrefix(field, "calls="); ok {
					c, err := strconv.ParseInt(n, 10, 64)
					if err != nil {
						return 0, nil, fmt.Errorf("INFO %s: %w", line, err)
					}
					calls[strings.TrimPrefix(key, "cmdstat_")] = c
				}
			}
		}
	}
	if total < 0 {
		return 0, nil, fmt.Errorf("INFO has no total_commands_processed")
	}
	return total, calls, sc.Err()
}

// Machine describes where the figures were taken.
type Machine struct {
	NumCPU     int    `json:"nproc"`
	GOMAXPROCS int    `json:"gomaxprocs"`
	CPUModel   string `json:"cpu_model"`
	GoVersion  string `json:"go_version"`
	GOOS       string `json:"goos"`
	GOARCH     string `json:"goarch"`
	Redis      string `json:"redis_version"`
	RedisAddr  string `json:"redis_addr"`
	OwnServer  bool   `json:"own_server"`
	// LeashCommit is the commit of the leash checkout the harness was built
	// from ("+dirty" when tracked files differ from it), or "" outside git.
	LeashCommit string  `json:"leash_commit"`
	RTT         Latency `json:"ping_rtt"`
}

// machineInfo describes this machine and the server at addr, and measures the
// loopback round trip with pings sequential PINGs.
func machineInfo(ctx context.Context, s *redisStats, addr string, own bool, pings int) (Machine, error) {
	m := Machine{
		NumCPU:      runtime.NumCPU(),
		GOMAXPROCS:  runtime.GOMAXPROCS(0),
		CPUModel:    cpuModel(),
		GoVersion:   runtime.Version(),
		GOOS:        runtime.GOOS,
		GOARCH:      runtime.GOARCH,
		RedisAddr:   addr,
		OwnServer:   own,
		LeashCommit: leashCommit(),
	}
	text, err := s.rdb.Info(ctx, "server").Result()
	if err != nil {
		return m, err
	}
	for _, line := range strings.Split(text, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "redis_version:"); ok {
			m.Redis = v
		}
	}
	m.RTT, err = pingRTT(ctx, s.rdb, pings)
	return m, err
}

// pingRTT sends n sequential PINGs (after a short warm-up) and returns their
// round-trip distribution.
func pingRTT(ctx context.Context, rdb *redis.Client, n int) (Latency, error) {
	for range 50 {
		if err := rdb.Ping(ctx).Err(); err != nil {
			return Latency{}, err
		}
	}
	samples := make([]time.Duration, 0, n)
	for range n {
		t0 := time.Now()
		if err := rdb.Ping(ctx).Err(); err != nil {
			return Latency{}, err
		}
		samples = append(samples, time.Since(t0))
	}
	return latencyOf(samples), nil
}

// leashCommit asks git (best effort) which commit of leash the harness runs
// from: the module root is the parent of the bench directory.
func leashCommit() string {
	out, err := exec.Command("git", "-C", "..", "rev-parse", "--short", "HEAD").Output()
	if err != nil {
		return ""
	}
	commit := strings.TrimSpace(string(out))
	dirty, err := exec.Command("git", "-C", "..", "status", "--porcelain", "--untracked-files=no").Output()
	if err == nil && len(strings.TrimSpace(string(dirty))) > 0 {
		commit += "+dirty"
	}
	return commit
}

// cpuModel returns the first "model name" of /proc/cpuinfo, or "" off Linux.
func cpuModel() string {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// sortedCommands returns the keys of m, largest count first.
func sortedCommands(m map[string]int64) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		if m[keys[i]] != m[keys[j]] {
			return m[keys[i]] > m[keys[j]]
		}
		return keys[i] < keys[j]
	})
	return keys
}
