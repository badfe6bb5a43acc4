package main

import (
	"context"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/internal/testredis"
)

// scriptCommand matches a command a Lua script runs: redis.call('hset', ...), with
// the subcommand of a container command (redis.call('pubsub', 'numsub', ...)).
var scriptCommand = regexp.MustCompile(`redis\.p?call\(\s*['"]([A-Za-z]+)['"](?:\s*,\s*['"]([A-Za-z]+)['"])?`)

// commandsOf returns the commands the scripts run, as INFO commandstats names them.
func commandsOf(ids ...scripts.ID) map[string]bool {
	out := map[string]bool{}
	for _, id := range ids {
		for _, m := range scriptCommand.FindAllStringSubmatch(scripts.Source(id), -1) {
			cmd := strings.ToLower(m[1])
			if cmd == "pubsub" {
				cmd += "|" + strings.ToLower(m[2])
			}
			out[cmd] = true
		}
	}
	return out
}

// TestScriptOnlyLists checks each leash contender's scriptOnly list against the Lua
// scripts its lock kind runs: every command they run is listed (else requests are
// overcounted), and nothing else is (a stale entry could hide a real request).
func TestScriptOnlyLists(t *testing.T) {
	for _, c := range []struct {
		kind string
		ids  []scripts.ID
		// unreached are commands of the scripts that this lock kind never runs.
		unreached []string
	}{
		{"leash", []scripts.ID{scripts.LockAcquire, scripts.LockRelease, scripts.LockHandoff, scripts.LockRenew,
			scripts.LockReleaseOwner, scripts.LockForceRelease, scripts.LockLeave},
			[]string{"lindex"}}, // lock_release_owner.lua's fair-lock branch (KEYS[3])
		{"leash-fair", []scripts.ID{scripts.FairAcquire, scripts.FairRelease, scripts.FairHandoff, scripts.FairLeave,
			scripts.FairForceRelease, scripts.LockRenew, scripts.LockReleaseOwner}, nil},
	} {
		k, ok := kindByName(c.kind)
		if !ok {
			t.Fatalf("no contender %q", c.kind)
		}
		run := commandsOf(c.ids...)
		for _, u := range c.unreached {
			delete(run, u)
		}
		for cmd := range run {
			if !slices.Contains(k.scriptOnly, cmd) {
				t.Errorf("%s: its scripts run %q, which scriptOnly does not list", c.kind, cmd)
			}
		}
		for _, cmd := range k.scriptOnly {
			if !run[cmd] {
				t.Errorf("%s: scriptOnly lists %q, which none of its scripts runs", c.kind, cmd)
			}
		}
	}
}

// TestFairContender checks the leash-fair contender's mechanics against a real
// server: waiters in three clients (three processes, as far as Redis can tell)
// queue in Redis and get the lock in the order they queued, and what the clients
// sent meanwhile is script calls and (un)subscriptions only, so every other
// command counted in that time ran inside a script and is in scriptOnly.
func TestFairContender(t *testing.T) {
	srv := testredis.New(t)
	kind, _ := kindByName("leash-fair")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	stats, err := newRedisStats(ctx, srv.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer stats.close()
	open := func() Contender {
		c, err := kind.open(srv.Addr())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	const name, waiters = "bench:test:fair-order", 3
	queue := "redisson_lock_queue:{" + name + "}"
	holder := open().NewLocker(name)
	ws := make([]Locker, waiters)
	for i := range ws {
		ws[i] = open().NewLocker(name)
	}
	if err := holder.Lock(ctx); err != nil {
		t.Fatal(err)
	}
	// As in the scenarios, the clients are connected before the counting starts.
	if err := stats.reset(ctx); err != nil {
		t.Fatal(err)
	}
	order := make(chan int, waiters)
	errs := make(chan error, waiters)
	for i, w := range ws {
		go func() {
			if err := w.Lock(ctx); err != nil {
				errs <- err
				return
			}
			order <- i // while holding: the sends are in acquisition order
			errs <- w.Unlock(ctx)
		}()
		// Start the next waiter only once this one is in the Redis queue.
		for {
			n, err := stats.rdb.LLen(ctx, queue).Result()
			if err != nil {
				t.Fatal(err)
			}
			if n == int64(i+1) {
				break
			}
			if ctx.Err() != nil {
				t.Fatalf("waiter %d never queued in %s (length %d)", i, queue, n)
			}
			time.Sleep(time.Millisecond)
		}
	}
	if err := holder.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	for range waiters {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	close(order)
	var got []int
	for i := range order {
		got = append(got, i)
	}
	if !slices.Equal(got, []int{0, 1, 2}) {
		t.Errorf("acquisition order %v, want the queue order [0 1 2]", got)
	}

	// The test's own LLENs are counted too, but llen is in scriptOnly: they land
	// on the script side and cannot make the check below fail.
	work, err := stats.work(ctx, kind.scriptOnly)
	if err != nil {
		t.Fatal(err)
	}
	// ping: rueidis's keep-alive on a connection idle for a while.
	sent := map[string]bool{"evalsha": true, "eval": true, "script|load": true, "ping": true,
		"subscribe": true, "unsubscribe": true, "psubscribe": true, "punsubscribe": true}
	var calls int64
	for cmd, n := range work.ByCommand {
		switch {
		case slices.Contains(kind.scriptOnly, cmd) || handshakeCommands[cmd]:
		case sent[cmd]:
			if cmd == "evalsha" || cmd == "eval" {
				calls += n
			}
		default:
			t.Errorf("leash-fair sent %q %d times, neither a script call nor in scriptOnly", cmd, n)
		}
	}
	// Each waiter queued with at least one call, and the lock changed hands three
	// times; the scripts ran more commands than that.
	if calls < waiters+1 || work.Commands <= work.Requests {
		t.Errorf("%d script calls, %d requests, %d server commands: %v", calls, work.Requests, work.Commands, work.ByCommand)
	}
}
