package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/leash-go/leash/lockapi"
	"github.com/redis/go-redis/v9"
)

// The harness puts every lock implementation behind the same two small interfaces,
// in the spirit of golang.org/x/sync's semaphore_bench_test.go, which runs the real
// semaphore and a naive one through one interface: a scenario is written once and
// never knows which implementation it drives.

// Locker is one lock handle on one lock name: one owner, used by one goroutine at a
// time. Lockers made for the same name by one Contender contend with each other
// exactly as handles of different processes would.
type Locker interface {
	// Lock waits until the handle holds the lock. It returns nil when held, and a
	// non-nil error (ctx's error once ctx has ended) otherwise.
	Lock(ctx context.Context) error
	// Unlock releases the hold taken by the last successful Lock.
	Unlock(ctx context.Context) error
}

// Contender is one lock implementation connected to one Redis: its client, its
// connection pool and whatever background machinery it runs. All Lockers made from
// one Contender share them, as the goroutines of one service would.
type Contender interface {
	// Name returns the contender's name as the report shows it.
	Name() string
	// NewLocker returns a new handle (a new owner) on the lock name. It talks to
	// nobody.
	NewLocker(name string) Locker
	// Close releases the client and ends every goroutine the contender started.
	Close() error
}

// contenderKind describes one implementation: how to open it and how to read the
// server's command statistics for it.
type contenderKind struct {
	name string
	// waits says in a few words how a blocked Lock waits, for the report.
	waits string
	// scriptOnly lists the commands (as INFO commandstats names them) that this
	// contender runs only inside its Lua scripts. Redis 7 counts commands run by a
	// script in commandstats, so requests = every call - these.
	scriptOnly []string
	// scenarios lists the letters of the scenarios among A–D the contender takes
	// part in (E is read from A, C and D); empty means all of them. F and G run
	// leash's Mutex alone, whatever this says.
	scenarios string
	// open connects a new instance to the server at addr.
	open func(addr string) (Contender, error)
}

// runsIn reports whether the contender takes part in the scenario with that letter.
func (k contenderKind) runsIn(letter string) bool {
	return k.scenarios == "" || strings.Contains(k.scenarios, letter)
}

// lease is the fixed lease of the contenders that have no watchdog (naive,
// redislock): long enough that no hold in any scenario comes near it.
const lease = 10 * time.Second

// allKinds lists the contenders in their default order. The order is rotated each
// repetition, so no contender always runs first (cold) or last.
var allKinds = []contenderKind{
	{
		name:  "leash",
		waits: "local FIFO queue + pub/sub wake-up, direct local handoff; a release grants another process's registered waiter directly",
		// lock_acquire/lock_release/lock_handoff/lock_leave.lua (each starting with
		// lock_lib.lua), lock_renew/lock_release_owner/lock_force_release.lua.
		scriptOnly: []string{"exists", "hexists", "hincrby", "hget", "pexpire", "pttl", "del", "publish", "hset", "hlen", "hdel", "pubsub|numsub",
			"lrange", "lrem", "rpush"},
		open: openLeash("leash", (*lockapi.Client).Mutex),
	},
	{
		name:  "leash-fair",
		waits: "Redisson FairLock queue in Redis; the release grants the queue's head directly (any process) and tells it on its own channel",
		// fair_acquire/fair_release/fair_handoff/fair_leave/fair_force_release.lua
		// (each starting with fair_lib.lua), plus lock_release_owner.lua and
		// lock_renew.lua, which serve both lock kinds.
		scriptOnly: []string{"exists", "hexists", "hincrby", "hset", "hget", "hdel", "hlen", "pexpire", "pttl", "del", "publish",
			"lindex", "llen", "lpop", "lpos", "lrange", "lrem", "rpush", "zadd", "zrem", "zscore"},
		// The fair lock is compared where waiting and handing off are measured; B
		// (nobody waits), F and G stay with leash's Mutex.
		scenarios: "ACD",
		open:      openLeash("leash-fair", (*lockapi.Client).FairMutex),
	},
	{
		name:       "naive",
		waits:      "SET NX PX, sleep 10 ms, retry",
		scriptOnly: []string{"get", "del"},
		open:       openNaive,
	},
	{
		name:       "redislock",
		waits:      "obtain script, linear 10 ms backoff",
		scriptOnly: []string{"set", "getrange", "get", "del", "pexpire", "pttl"},
		open:       openRedislock,
	},
	{
		name:       "redsync",
		waits:      "SET NX, random 50-250 ms retry delay",
		scriptOnly: []string{"get", "del", "pexpire"},
		open:       openRedsync,
	},
	{
		name:       "rueidislock",
		waits:      "client-side-caching invalidation wake-up",
		scriptOnly: []string{"set", "get", "del", "pexpireat"},
		open:       openRueidislock,
	},
}

// kindByName returns the contender kind called name.
func kindByName(name string) (contenderKind, bool) {
	for _, k := range allKinds {
		if k.name == name {
			return k, true
		}
	}
	return contenderKind{}, false
}

// selectKinds returns the kinds named in filter (a comma list; empty means all),
// in allKinds order.
func selectKinds(filter string) ([]contenderKind, error) {
	if strings.TrimSpace(filter) == "" {
		return append([]contenderKind(nil), allKinds...), nil
	}
	want := map[string]bool{}
	for _, f := range strings.Split(filter, ",") {
		f = strings.TrimSpace(strings.ToLower(f))
		if f == "" {
			continue
		}
		if _, ok := kindByName(f); !ok {
			return nil, fmt.Errorf("unknown contender %q (have %s)", f, kindNames(allKinds))
		}
		want[f] = true
	}
	var out []contenderKind
	for _, k := range allKinds {
		if want[k.name] {
			out = append(out, k)
		}
	}
	return out, nil
}

// kindNames joins the kinds' names with commas.
func kindNames(kinds []contenderKind) string {
	names := make([]string, len(kinds))
	for i, k := range kinds {
		names[i] = k.name
	}
	return strings.Join(names, ",")
}

// rotate returns kinds rotated left by n, so repetition n starts with a different
// contender.
func rotate(kinds []contenderKind, n int) []contenderKind {
	if len(kinds) == 0 {
		return nil
	}
	n %= len(kinds)
	return append(append([]contenderKind(nil), kinds[n:]...), kinds[:n]...)
}

// ---- leash ----

// leashContender is one lockapi.Client; each Locker is one handle (one owner),
// from Client.Mutex or Client.FairMutex (both return a *lockapi.Mutex).
type leashContender struct {
	name   string
	c      *lockapi.Client
	handle func(*lockapi.Client, string) *lockapi.Mutex
}

// openLeash returns an opener of leash clients (with default Options) whose
// handles come from handle.
func openLeash(name string, handle func(*lockapi.Client, string) *lockapi.Mutex) func(string) (Contender, error) {
	return func(addr string) (Contender, error) {
		c, err := lockapi.New(lockapi.Options{Addrs: []string{addr}})
		if err != nil {
			return nil, err
		}
		return &leashContender{name: name, c: c, handle: handle}, nil
	}
}

func (l *leashContender) Name() string { return l.name }
func (l *leashContender) Close() error { return l.c.Close() }
func (l *leashContender) NewLocker(name string) Locker {
	return leashLocker{h: l.handle(l.c, name)}
}

// SharedCommandsSent implements sharedCounter.
func (l *leashContender) SharedCommandsSent(ctx context.Context) (int64, error) {
	s, err := l.c.Stats(ctx)
	return int64(s.SharedPlainCommands), err
}

// sharedCounter is a contender that sends, outside its scripts, commands that
// its scripts also run (leash's uncontended paths: HDEL, PUBLISH, LINDEX; see
// scripts.Redis.SharedCommandsSent). INFO commandstats counts both alike, and
// those commands are in the contender's scriptOnly list, so the harness adds
// the count to its requests (RedisWork.addShared).
type sharedCounter interface {
	SharedCommandsSent(ctx context.Context) (int64, error)
}

// sharedSent returns c's count of such commands since it was opened (0 for a
// contender that sends none).
func sharedSent(ctx context.Context, c Contender) (int64, error) {
	if sc, ok := c.(sharedCounter); ok {
		return sc.SharedCommandsSent(ctx)
	}
	return 0, nil
}

type leashLocker struct{ h *lockapi.Mutex }

func (l leashLocker) Lock(ctx context.Context) error   { return l.h.Lock(ctx) }
func (l leashLocker) Unlock(ctx context.Context) error { return l.h.Unlock(ctx) }

// ---- naive ----

// naiveContender is the lock most services write by hand: SET key token NX PX, on
// failure sleep 10 ms and try again; release with a compare-and-delete script.
type naiveContender struct{ rdb *redis.Client }

// naiveRelease deletes the key only if it still carries the caller's token.
var naiveRelease = redis.NewScript(`
if redis.call("get", KEYS[1]) ~= ARGV[1] then
	return 0
end
return redis.call("del", KEYS[1])`)

// naivePoll is the naive lock's sleep between attempts.
const naivePoll = 10 * time.Millisecond

func openNaive(addr string) (Contender, error) {
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	if err := rdb.Ping(context.Background()).Err(); err != nil {
		rdb.Close()
		return nil, err
	}
	return &naiveContender{rdb: rdb}, nil
}

func (n *naiveContender) Name() string { return "naive" }
func (n *naiveContender) Close() error { return n.rdb.Close() }
func (n *naiveContender) NewLocker(name string) Locker {
	return &naiveLocker{rdb: n.rdb, key: name, token: newToken()}
}

type naiveLocker struct {
	rdb        *redis.Client
	key, token string
}

func (l *naiveLocker) Lock(ctx context.Context) error {
	var t *time.Timer
	for {
		ok, err := l.rdb.SetNX(ctx, l.key, l.token, lease).Result()
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return err
		}
		if ok {
			return nil
		}
		if t == nil {
			t = time.NewTimer(naivePoll)
			defer t.Stop()
		} else {
			t.Reset(naivePoll)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

func (l *naiveLocker) Unlock(ctx context.Context) error {
	n, err := naiveRelease.Run(ctx, l.rdb, []string{l.key}, l.token).Int64()
	if err != nil {
		return err
	}
	if n == 0 {
		return errNotHeld
	}
	return nil
}

// errNotHeld is what the harness's own wrappers return from Unlock when the lock
// was not held by the handle (a peer reported it without an error of its own).
var errNotHeld = errors.New("bench: lock not held by this handle")

// newToken returns a random 128-bit token in hex.
func newToken() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err) // crypto/rand.Read never fails on Linux
	}
	return hex.EncodeToString(b[:])
}
