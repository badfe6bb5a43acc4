package lockapi_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
	"github.com/redis/rueidis"
)

// Helpers of the fair-lock integration tests (fair_*_test.go), prefixed "fair".
// The tests also use the package's shared helpers (newClient, do, stats, unlock in
// main_test.go).
//
// Multi-process tests re-execute this test binary running only
// TestFairHelperProcess, with the helper's role and parameters in environment
// variables. A helper talks to the parent only through Redis.
const (
	envFairRole   = "LEASH_FAIR_HELPER_ROLE" // "order", "dead" or "crowd"; unset: not a helper
	envFairAddr   = "LEASH_FAIR_HELPER_ADDR"
	envFairLock   = "LEASH_FAIR_HELPER_LOCK"
	envFairCmds   = "LEASH_FAIR_HELPER_CMDS"   // order: the list the helper BLPOPs its orders from
	envFairResult = "LEASH_FAIR_HELPER_RESULT" // order, crowd: the list waiters RPUSH to when they get the lock
	envFairAgain  = "LEASH_FAIR_HELPER_AGAIN"  // order: the waiter index that re-acquires right after its Unlock
	envFairCount  = "LEASH_FAIR_HELPER_COUNT"  // crowd: how many waiters (goroutines, one handle each)
	envFairReady  = "LEASH_FAIR_HELPER_READY"  // dead: the key set once the waiter is in the Redis queue
	envFairWait   = "LEASH_FAIR_HELPER_WAIT"   // FairWaitTimeout of the helper's client (optional)
)

// ---- wire names, computed here independently of leash (PROTOCOL.md) ----

// fairTagged wraps a lock name in a cluster hash tag unless it already has one.
func fairTagged(name string) string {
	if strings.Contains(name, "{") {
		return name
	}
	return "{" + name + "}"
}

func fairQueueKey(name string) string   { return "redisson_lock_queue:" + fairTagged(name) }
func fairTimeoutKey(name string) string { return "redisson_lock_timeout:" + fairTagged(name) }
func fairChannel(name string) string    { return "redisson_lock__channel:" + fairTagged(name) }

// ---- parent-side helpers ----

// fairName is a key name unique to the test.
func fairName(t *testing.T, tag string) string {
	name := "leash-fair:" + strings.NewReplacer("/", ":", " ", "_").Replace(t.Name())
	if tag != "" {
		name += ":" + tag
	}
	return name
}

// fairList returns a list's elements (LRANGE 0 -1).
func fairList(t *testing.T, srv *testredis.Server, key string) []string {
	t.Helper()
	got := do(t, srv, "LRANGE", key, "0", "-1")
	if got == "" {
		return nil
	}
	return strings.Split(got, "\n")
}

// fairLen returns LLEN key.
func fairLen(t *testing.T, srv *testredis.Server, key string) int {
	t.Helper()
	n, err := strconv.Atoi(do(t, srv, "LLEN", key))
	if err != nil {
		t.Fatalf("LLEN %s: %v", key, err)
	}
	return n
}

// fairScore returns ZSCORE key member in ms, and whether the member exists.
func fairScore(t *testing.T, srv *testredis.Server, key, member string) (int64, bool) {
	t.Helper()
	got := do(t, srv, "ZSCORE", key, member)
	if got == "" {
		return 0, false
	}
	f, err := strconv.ParseFloat(got, 64)
	if err != nil {
		t.Fatalf("ZSCORE %s %s = %q: %v", key, member, got, err)
	}
	return int64(f), true
}

// fairWaitFor polls cond every few milliseconds until it holds and fails the test
// if it does not within timeout. Test goroutine only.
func fairWaitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		<-tick.C
	}
}

// fairCtx returns a context bounded by d, cancelled when the test ends.
func fairCtx(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// fairWaitLen waits until LLEN key == n.
func fairWaitLen(t *testing.T, srv *testredis.Server, key string, n int, timeout time.Duration) {
	t.Helper()
	fairWaitFor(t, timeout, "LLEN "+key+" == "+strconv.Itoa(n), func() bool { return fairLen(t, srv, key) == n })
}

// fairEnqueue starts an Acquire of m and waits until the Redis queue holds n
// entries, returning the Acquire channel and m's owner field (the new tail). n is
// the expected queue length once m is queued.
func fairEnqueue(t *testing.T, srv *testredis.Server, m *lockapi.Mutex, ctx context.Context, n int, opts ...lockapi.AcquireOption) (<-chan error, string) {
	t.Helper()
	ch := m.Acquire(ctx, opts...)
	fairWaitLen(t, srv, fairQueueKey(m.Name()), n, 10*time.Second)
	q := fairList(t, srv, fairQueueKey(m.Name()))
	return ch, q[len(q)-1]
}

// fairRecv waits up to d for an Acquire channel's value; ok is false on timeout.
func fairRecv(ch <-chan error, d time.Duration) (err error, ok bool) {
	select {
	case err := <-ch:
		return err, true
	case <-time.After(d):
		return nil, false
	}
}

// fairMustGet fails the test unless ch answers nil within 3 s.
func fairMustGet(t *testing.T, what string, ch <-chan error) {
	t.Helper()
	if err, ok := fairRecv(ch, 3*time.Second); !ok || err != nil {
		t.Fatalf("%s: %v (answered %v)", what, err, ok)
	}
}

// fairStillWaiting reports whether an Acquire channel is still without a value
// after d: the one place a short fixed wait is itself the assertion.
func fairStillWaiting(ch <-chan error, d time.Duration) (bool, error) {
	select {
	case err := <-ch:
		return false, err
	case <-time.After(d):
		return true, nil
	}
}

// fairMustBeClean asserts the lock, its queue and its deadline set are all gone.
func fairMustBeClean(t *testing.T, srv *testredis.Server, name string) {
	t.Helper()
	if got := do(t, srv, "EXISTS", name, fairQueueKey(name), fairTimeoutKey(name)); got != "0" {
		t.Errorf("keys left behind: EXISTS = %s (lock %q, queue %q, deadlines %q)", got,
			do(t, srv, "HGETALL", name), fairList(t, srv, fairQueueKey(name)),
			do(t, srv, "ZRANGE", fairTimeoutKey(name), "0", "-1", "WITHSCORES"))
	}
}

// fairStat sums CommandStats entries.
func fairStat(t *testing.T, srv *testredis.Server, cmds ...string) int64 {
	t.Helper()
	st, err := srv.CommandStats()
	if err != nil {
		t.Fatalf("CommandStats: %v", err)
	}
	var n int64
	for _, c := range cmds {
		n += st[c]
	}
	return n
}

// fairSyncBuffer is a bytes.Buffer safe for a child's output copier and the test.
type fairSyncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *fairSyncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *fairSyncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// fairProc is a helper process.
type fairProc struct {
	cmd  *exec.Cmd
	out  *fairSyncBuffer
	done chan struct{}
	err  error // valid once done is closed
}

// startFairHelper re-executes the test binary as a helper with role and the given
// environment. The process is killed (if still running) and reaped when the test
// ends.
func startFairHelper(t *testing.T, role string, env ...string) *fairProc {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestFairHelperProcess$", "-test.count=1", "-test.timeout=3m")
	cmd.Env = append(append(os.Environ(), envFairRole+"="+role), env...)
	p := &fairProc{cmd: cmd, out: &fairSyncBuffer{}, done: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = p.out, p.out
	if err := cmd.Start(); err != nil {
		t.Fatalf("start helper %s: %v", role, err)
	}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			cmd.Process.Kill()
			<-p.done
		}
	})
	return p
}

// wait waits up to d for the helper to exit and fails the test unless it exited
// with status 0.
func (p *fairProc) wait(t *testing.T, d time.Duration) {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(d):
		t.Fatalf("helper %d still running after %v; output:\n%s", p.cmd.Process.Pid, d, p.out.String())
	}
	if p.err != nil {
		t.Fatalf("helper %d: %v; output:\n%s", p.cmd.Process.Pid, p.err, p.out.String())
	}
}

// ---- helper processes ----

// TestFairHelperProcess is not a test: it is the body of the fair-lock tests'
// helper processes, and returns at once in a normal run.
func TestFairHelperProcess(t *testing.T) {
	role := os.Getenv(envFairRole)
	if role == "" {
		return
	}
	addr, lock := os.Getenv(envFairAddr), os.Getenv(envFairLock)
	opts := lockapi.Options{Addrs: []string{addr}}
	if s := os.Getenv(envFairWait); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil {
			t.Fatalf("%s: %v", envFairWait, err)
		}
		opts.FairWaitTimeout = d
	}
	c, err := lockapi.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	rc, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{addr}, DisableCache: true})
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	switch role {
	case "order":
		fairHelperOrder(t, ctx, c, rc, lock)
	case "dead":
		fairHelperDead(t, ctx, c, rc, lock)
	case "crowd":
		fairHelperCrowd(t, ctx, c, rc, lock)
	default:
		t.Fatalf("unknown helper role %q", role)
	}
}

// fairHelperOrder starts one waiter (a goroutine with its own handle) per order
// popped from the command list, until "stop". A waiter that gets the lock RPUSHes
// its index to the result list and unlocks; the waiter whose index is in
// envFairAgain then asks again at once and pushes its index a second time.
func fairHelperOrder(t *testing.T, ctx context.Context, c *lockapi.Client, rc rueidis.Client, lock string) {
	cmds, result, again := os.Getenv(envFairCmds), os.Getenv(envFairResult), os.Getenv(envFairAgain)
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		kv, err := rc.Do(ctx, rc.B().Blpop().Key(cmds).Timeout(60).Build()).AsStrSlice()
		if err != nil {
			t.Errorf("BLPOP %s: %v", cmds, err)
			return
		}
		idx := kv[1]
		if idx == "stop" {
			return
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			m := c.FairMutex(lock)
			rounds := 1
			if idx == again {
				rounds = 2
			}
			for range rounds {
				if err := m.Lock(ctx); err != nil {
					t.Errorf("waiter %s: Lock: %v", idx, err)
					return
				}
				if err := rc.Do(ctx, rc.B().Rpush().Key(result).Element(idx).Build()).Error(); err != nil {
					t.Errorf("waiter %s: RPUSH: %v", idx, err)
				}
				if err := m.Unlock(ctx); err != nil {
					t.Errorf("waiter %s: Unlock: %v", idx, err)
					return
				}
			}
		}()
	}
}

// fairHelperDead queues one waiter, sets the ready key once the waiter is in the
// Redis queue, and waits to be killed.
func fairHelperDead(t *testing.T, ctx context.Context, c *lockapi.Client, rc rueidis.Client, lock string) {
	m := c.FairMutex(lock)
	got := m.Acquire(ctx)
	prefix := c.ID() + ":"
	deadline := time.Now().Add(20 * time.Second)
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	for queued := false; !queued; {
		if time.Now().After(deadline) {
			t.Fatalf("the waiter did not show up in the Redis queue within 20s")
		}
		q, err := rc.Do(ctx, rc.B().Lrange().Key(fairQueueKey(lock)).Start(0).Stop(-1).Build()).AsStrSlice()
		if err != nil {
			t.Fatalf("LRANGE: %v", err)
		}
		for _, f := range q {
			queued = queued || strings.HasPrefix(f, prefix)
		}
		<-tick.C
	}
	if err := rc.Do(ctx, rc.B().Set().Key(os.Getenv(envFairReady)).Value("1").Build()).Error(); err != nil {
		t.Fatalf("SET ready: %v", err)
	}
	select {
	case err := <-got:
		t.Errorf("the waiter was to be killed while waiting; Lock returned %v", err)
	case <-ctx.Done():
		t.Errorf("not killed")
	}
}

// fairHelperCrowd runs envFairCount waiters, each a goroutine with its own handle.
// A waiter that gets the lock reads the lock hash, whose only field must be its own
// owner field, RPUSHes that field to the result list, and unlocks.
func fairHelperCrowd(t *testing.T, ctx context.Context, c *lockapi.Client, rc rueidis.Client, lock string) {
	n, err := strconv.Atoi(os.Getenv(envFairCount))
	if err != nil {
		t.Fatalf("%s: %v", envFairCount, err)
	}
	result := os.Getenv(envFairResult)
	prefix := c.ID() + ":"
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			m := c.FairMutex(lock)
			if err := m.Lock(ctx); err != nil {
				t.Errorf("waiter %d: Lock: %v", i, err)
				return
			}
			// An early local grant runs under the previous holder's field until its
			// handoff's reply (engine/handoff.go); HoldCount waits for that reply, so
			// the hash read next shows this holder's own field.
			if n, err := m.HoldCount(ctx); err != nil || n != 1 {
				t.Errorf("waiter %d: HoldCount = %d, %v; want 1", i, n, err)
			}
			fields, err := rc.Do(ctx, rc.B().Hkeys().Key(lock).Build()).AsStrSlice()
			field := "?"
			switch {
			case err != nil:
				t.Errorf("waiter %d: HKEYS: %v", i, err)
			case len(fields) != 1 || !strings.HasPrefix(fields[0], prefix):
				t.Errorf("waiter %d holds the lock but its hash has fields %q (want one field of %s)", i, fields, prefix)
			default:
				field = fields[0]
			}
			if err := rc.Do(ctx, rc.B().Rpush().Key(result).Element(field).Build()).Error(); err != nil {
				t.Errorf("waiter %d: RPUSH: %v", i, err)
			}
			if err := m.Unlock(ctx); err != nil {
				t.Errorf("waiter %d: Unlock: %v", i, err)
			}
		}()
	}
	wg.Wait()
}
