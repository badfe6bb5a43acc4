package lockapi_test

import (
	"bufio"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
	"github.com/redis/rueidis"
)

// A foreign Redisson client, played with raw Lua over testredis's own connection,
// so nothing of leash is involved on its side. The scripts follow Redisson's RLock
// as PROTOCOL.md describes it.
const (
	// KEYS[1] lock; ARGV[1] lease ms, ARGV[2] owner. nil = held, else PTTL.
	foreignTryLock = `if (redis.call('exists', KEYS[1]) == 0) or (redis.call('hexists', KEYS[1], ARGV[2]) == 1) then ` +
		`redis.call('hincrby', KEYS[1], ARGV[2], 1); redis.call('pexpire', KEYS[1], ARGV[1]); return nil; end; ` +
		`return redis.call('pttl', KEYS[1]);`
	// KEYS[1] lock, KEYS[2] channel; ARGV[1] message, ARGV[2] lease ms, ARGV[3] owner.
	// nil = not the owner, 0 = still held, 1 = released (and published).
	foreignUnlock = `if (redis.call('hexists', KEYS[1], ARGV[3]) == 0) then return nil; end; ` +
		`local counter = redis.call('hincrby', KEYS[1], ARGV[3], -1); ` +
		`if (counter > 0) then redis.call('pexpire', KEYS[1], ARGV[2]); return 0; end; ` +
		`redis.call('del', KEYS[1]); redis.call('publish', KEYS[2], ARGV[1]); return 1;`
)

type foreignClient struct {
	srv   *testredis.Server
	owner string // "<uuid>:<thread id>"
}

func newForeign(t *testing.T, srv *testredis.Server) *foreignClient {
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	h := hex.EncodeToString(b)
	return &foreignClient{srv: srv, owner: h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:] + ":1"}
}

// redissonChannel is the unlock channel as Redisson names it, computed here
// independently of leash.
func redissonChannel(name string) string {
	if strings.Contains(name, "{") {
		return "redisson_lock__channel:" + name
	}
	return "redisson_lock__channel:{" + name + "}"
}

// tryLock returns "" when held, else the PTTL as text.
func (f *foreignClient) tryLock(t *testing.T, name string, lease time.Duration) string {
	t.Helper()
	return do(t, f.srv, "EVAL", foreignTryLock, "1", name, strconv.FormatInt(lease.Milliseconds(), 10), f.owner)
}

func (f *foreignClient) unlock(t *testing.T, name string) string {
	t.Helper()
	return do(t, f.srv, "EVAL", foreignUnlock, "2", name, redissonChannel(name), "0", "30000", f.owner)
}

// respConn is a raw RESP2 connection, used as the foreign client's subscriber.
type respConn struct {
	conn net.Conn
	r    *bufio.Reader
}

func dialRESP(t *testing.T, addr string) *respConn {
	t.Helper()
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &respConn{conn: conn, r: bufio.NewReader(conn)}
}

func (c *respConn) send(args ...string) error {
	var b strings.Builder
	fmt.Fprintf(&b, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(&b, "$%d\r\n%s\r\n", len(a), a)
	}
	c.conn.SetWriteDeadline(time.Now().Add(5 * time.Second))
	_, err := c.conn.Write([]byte(b.String()))
	return err
}

// read returns the next reply within d: a string, an int64, nil, or a []any.
// A timeout is reported as an error for which isTimeout is true.
func (c *respConn) read(d time.Duration) (any, error) {
	c.conn.SetReadDeadline(time.Now().Add(d))
	return c.readValue()
}

func (c *respConn) readValue() (any, error) {
	line, err := c.r.ReadString('\n')
	if err != nil {
		return nil, err
	}
	line = strings.TrimSuffix(line, "\r\n")
	if line == "" {
		return nil, errors.New("empty RESP line")
	}
	body := line[1:]
	switch line[0] {
	case '+':
		return body, nil
	case '-':
		return nil, errors.New(body)
	case ':':
		return strconv.ParseInt(body, 10, 64)
	case '$':
		n, err := strconv.Atoi(body)
		if err != nil || n < 0 {
			return nil, err
		}
		buf := make([]byte, n+2)
		if _, err := io.ReadFull(c.r, buf); err != nil {
			return nil, err
		}
		return string(buf[:n]), nil
	case '*':
		n, err := strconv.Atoi(body)
		if err != nil || n < 0 {
			return nil, err
		}
		out := make([]any, n)
		for i := range out {
			if out[i], err = c.readValue(); err != nil {
				return nil, err
			}
		}
		return out, nil
	}
	return nil, fmt.Errorf("unexpected RESP line %q", line)
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// TestInteropForeignHoldsLeashWaits: a Redisson-style holder blocks a leash waiter,
// and its unlock message wakes the waiter long before the foreign lease would end.
func TestInteropForeignHoldsLeashWaits(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	c := newClient(t, srv, lockapi.Options{})
	java := newForeign(t, srv)
	name := lockName(t, "")
	const foreignLease = 30 * time.Second

	if got := java.tryLock(t, name, foreignLease); got != "" {
		t.Fatalf("foreign tryLock of a free lock = %q, want nil", got)
	}
	if got := java.tryLock(t, name, foreignLease); got != "" { // reentrant
		t.Fatalf("foreign re-entry = %q, want nil", got)
	}
	m := c.Mutex(name)
	if ok, err := m.TryLock(ctxFor(t, 5*time.Second), 0, 0); ok || err != nil {
		t.Fatalf("leash TryLock while the foreign client holds = %v, %v", ok, err)
	}
	ch := m.Acquire(ctxFor(t, 60*time.Second))
	eventually(t, 5*time.Second, "the leash waiter to subscribe", func() bool {
		return numSub(t, srv, redissonChannel(name)) == "1"
	})
	if still, err := pending(ch, 300*time.Millisecond); !still {
		t.Fatalf("leash Lock completed while the foreign client holds: %v", err)
	}
	if h := hashOf(t, srv, name); len(h) != 1 || h[java.owner] != "2" {
		t.Fatalf("hash while the foreign client holds = %v, want only %s=2", h, java.owner)
	}
	// A partial foreign release publishes nothing and keeps the waiter waiting.
	if got := java.unlock(t, name); got != "0" {
		t.Fatalf("foreign partial unlock = %q, want 0", got)
	}
	if still, err := pending(ch, 200*time.Millisecond); !still {
		t.Fatalf("leash Lock completed after a partial foreign unlock: %v", err)
	}

	start := time.Now()
	if got := java.unlock(t, name); got != "1" {
		t.Fatalf("foreign unlock = %q, want 1", got)
	}
	err, ok := receive(ch, 5*time.Second)
	if !ok || err != nil {
		t.Fatalf("leash waiter after the foreign unlock: ok=%v err=%v", ok, err)
	}
	took := time.Since(start)
	t.Logf("leash waiter woken %v after the foreign unlock", took)
	if took > 2*time.Second {
		t.Fatalf("leash waiter woken %v after the foreign unlock; the message should wake it at once", took)
	}
	if v := soleField(t, srv, c, name); v != "1" {
		t.Fatalf("leash holder's count = %q", v)
	}
	// The foreign owner cannot release leash's hold.
	if got := java.unlock(t, name); got != "" {
		t.Fatalf("foreign unlock of leash's hold = %q, want nil", got)
	}
	unlock(t, m)
	mustBeLocked(t, srv, name, false)
}

// TestInteropLeashHoldsForeignWaits: while leash holds, a Redisson-style client
// sees the lock taken (a PTTL), finds leash's owner field in Redisson's layout, and
// is woken by the "0" leash publishes on Redisson's channel.
func TestInteropLeashHoldsForeignWaits(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ test, tag string }{
		{"PlainName", "plain"},
		{"NameWithHashTag", "{tagged}:x"},
	} {
		t.Run(tc.test, func(t *testing.T) {
			t.Parallel()
			srv := testredis.New(t)
			c := newClient(t, srv, lockapi.Options{})
			java := newForeign(t, srv)
			name := lockName(t, tc.tag)
			channel := redissonChannel(name)
			ctx := ctxFor(t, 30*time.Second)

			m := c.Mutex(name)
			lockWithin(t, m, 5*time.Second)
			if v := soleField(t, srv, c, name); v != "1" {
				t.Fatalf("leash's hold count in the hash = %q, want 1", v)
			}
			got := java.tryLock(t, name, 30*time.Second)
			pttl, err := strconv.Atoi(got)
			if err != nil || pttl <= 0 || pttl > int(lockapi.DefaultWatchdogTimeout.Milliseconds()) {
				t.Fatalf("foreign tryLock while leash holds = %q; want a PTTL in (0, 30000]", got)
			}
			if got := java.unlock(t, name); got != "" {
				t.Fatalf("foreign unlock of leash's hold = %q, want nil", got)
			}

			sub := dialRESP(t, srv.Addr())
			if err := sub.send("SUBSCRIBE", channel); err != nil {
				t.Fatal(err)
			}
			if v, err := sub.read(5 * time.Second); err != nil || fmt.Sprint(v) != fmt.Sprint([]any{"subscribe", channel, int64(1)}) {
				t.Fatalf("SUBSCRIBE %s = %v, %v", channel, v, err)
			}
			// Re-entry and a partial release: still leash's, nothing published.
			lockWithin(t, m, 5*time.Second)
			if v := soleField(t, srv, c, name); v != "2" {
				t.Fatalf("hold count after re-entry = %q, want 2", v)
			}
			unlock(t, m)
			if v, err := sub.read(150 * time.Millisecond); !isTimeout(err) {
				t.Fatalf("a partial leash release published %v (err %v)", v, err)
			}

			unlock(t, m)
			v, err := sub.read(5 * time.Second)
			if err != nil || fmt.Sprint(v) != fmt.Sprint([]any{"message", channel, "0"}) {
				t.Fatalf("message after leash's release = %v, %v; want [message %s 0]", v, err, channel)
			}
			if got := java.tryLock(t, name, 30*time.Second); got != "" {
				t.Fatalf("foreign tryLock after leash's release = %q, want nil", got)
			}
			if h := hashOf(t, srv, name); len(h) != 1 || h[java.owner] != "1" {
				t.Fatalf("hash held by the foreign client = %v", h)
			}
			if ok, err := m.TryLock(ctx, 0, 0); ok || err != nil {
				t.Fatalf("leash TryLock while the foreign client holds = %v, %v", ok, err)
			}
			if got := java.unlock(t, name); got != "1" {
				t.Fatalf("foreign unlock = %q, want 1", got)
			}
			mustBeLocked(t, srv, name, false)
		})
	}
}

// TestInteropPersistentForeignKey: a foreign hold without an expiry.
func TestInteropPersistentForeignKey(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	c := newClient(t, srv, lockapi.Options{})
	java := newForeign(t, srv)
	name := lockName(t, "")
	ctx := ctxFor(t, 30*time.Second)
	do(t, srv, "HSET", name, java.owner, "1")

	m := c.Mutex(name)
	if ttl, err := m.RemainTTL(ctx); err != nil || ttl != -1 {
		t.Fatalf("RemainTTL of a key without expiry = %v, %v; want -1", ttl, err)
	}
	if ok, err := m.IsLocked(ctx); err != nil || !ok {
		t.Fatalf("IsLocked = %v, %v", ok, err)
	}
	ch := m.Acquire(ctx)
	eventually(t, 5*time.Second, "the leash waiter to subscribe", func() bool {
		return numSub(t, srv, redissonChannel(name)) == "1"
	})
	if got := java.unlock(t, name); got != "1" {
		t.Fatalf("foreign unlock = %q, want 1", got)
	}
	if err, ok := receive(ch, 3*time.Second); !ok || err != nil {
		t.Fatalf("leash waiter after the foreign unlock: ok=%v err=%v", ok, err)
	}
	unlock(t, m)
}

// TestCallerOwnedClient: leash over a rueidis client the caller made (Options.Client)
// works, and Close releases leash's locks but leaves the caller's client open.
func TestCallerOwnedClient(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	rc, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{srv.Addr()}, DisableCache: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rc.Close) // registered first, so it runs after the leash client's Close
	c := newClient(t, srv, lockapi.Options{Client: rc})
	name := lockName(t, "")

	m := c.Mutex(name)
	lockWithin(t, m, 5*time.Second)
	if v := soleField(t, srv, c, name); v != "1" {
		t.Fatalf("count = %q", v)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	mustBeLocked(t, srv, name, false)
	ctx := ctxFor(t, 5*time.Second)
	if err := rc.Do(ctx, rc.B().Ping().Build()).Error(); err != nil {
		t.Fatalf("the caller's rueidis client after leash's Close: %v", err)
	}
}

// TestSelectedDB: Options.DB puts the lock hash in that database.
func TestSelectedDB(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	c3 := newClient(t, srv, lockapi.Options{DB: 3})
	c0 := newClient(t, srv, lockapi.Options{})
	name := lockName(t, "")

	m := c3.Mutex(name)
	lockWithin(t, m, 5*time.Second)
	mustBeLocked(t, srv, name, false) // testredis talks to DB 0
	raw := dialRESP(t, srv.Addr())
	for _, cmd := range [][]string{{"SELECT", "3"}, {"EXISTS", name}} {
		if err := raw.send(cmd...); err != nil {
			t.Fatal(err)
		}
	}
	if v, err := raw.read(5 * time.Second); err != nil || v != "OK" {
		t.Fatalf("SELECT 3 = %v, %v", v, err)
	}
	if v, err := raw.read(5 * time.Second); err != nil || v != int64(1) {
		t.Fatalf("EXISTS %s in DB 3 = %v, %v; want 1", name, v, err)
	}
	// The same name in DB 0 is another lock.
	o := c0.Mutex(name)
	if ok, err := o.TryLock(ctxFor(t, 5*time.Second), 0, 0); !ok || err != nil {
		t.Fatalf("TryLock of the same name in DB 0 = %v, %v", ok, err)
	}
	unlock(t, o)
	unlock(t, m)
}

// TestInteropForeignWaiterNotStarved: leash clients with local chains hammer a lock
// (three clients of three goroutines, 200 µs holds) while a Redisson-style client
// waits as Redisson does: it subscribes, tries, tries again on each unlock message
// (or when the TTL it was told runs out), and unsubscribes once it holds the lock.
// Leash heads that need not race give way to it (Options.PublicYield; see
// engine/directgrant.go), so it loses few races; without that it lost about a
// hundred for each acquisition and waited 0.3-1 s for each.
func TestInteropForeignWaiterNotStarved(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	name := lockName(t, "")
	stop := make(chan struct{})
	var wg sync.WaitGroup
	defer func() {
		close(stop)
		wg.Wait()
	}()
	for range 3 {
		c := newClient(t, srv, lockapi.Options{})
		for range 3 {
			m := c.Mutex(name)
			wg.Go(func() {
				for {
					select {
					case <-stop:
						return
					default:
					}
					if err := m.Lock(ctxFor(t, 30*time.Second)); err != nil {
						t.Errorf("Lock: %v", err)
						return
					}
					for t0 := time.Now(); time.Since(t0) < 200*time.Microsecond; {
					} // a short hold, spun: a sleep would last a millisecond or more
					if err := m.Unlock(ctxFor(t, 30*time.Second)); err != nil {
						t.Errorf("Unlock: %v", err)
						return
					}
				}
			})
		}
	}
	java := newForeign(t, srv)
	sub := dialRESP(t, srv.Addr())
	channel := redissonChannel(name)
	const rounds, bound = 20, 10 * time.Second
	start := time.Now()
	var worst time.Duration
	var tries, worstTries int
	for range rounds {
		t0 := time.Now()
		if err := sub.send("SUBSCRIBE", channel); err != nil {
			t.Fatal(err)
		}
		for n := 1; ; n++ {
			got := java.tryLock(t, name, 30*time.Second)
			tries++
			worstTries = max(worstTries, n)
			if got == "" {
				break
			}
			if time.Since(start) > bound {
				t.Fatalf("the foreign client took the lock %d times in %v: starved", rounds, bound)
			}
			ttl, _ := strconv.Atoi(got)
			_, _ = sub.read(time.Duration(max(ttl, 1)) * time.Millisecond) // a message (or the SUBSCRIBE reply), or its TTL
		}
		worst = max(worst, time.Since(t0))
		if err := sub.send("UNSUBSCRIBE", channel); err != nil {
			t.Fatal(err)
		}
		if got := java.unlock(t, name); got != "1" {
			t.Fatalf("foreign unlock = %q, want 1", got)
		}
		drainRESP(sub)
	}
	t.Logf("%d foreign acquisitions in %v, the longest wait %v; %d tries, at most %d for one", rounds, time.Since(start), worst, tries, worstTries)
	// A try lost is a race lost to a leash head.
	if tries > 15*rounds {
		t.Fatalf("the foreign client needed %d tries for %d acquisitions: leash heads won the races", tries, rounds)
	}
}

// drainRESP reads whatever c has buffered (replies to (un)subscribe, messages)
// until it has been quiet for a moment.
func drainRESP(c *respConn) {
	for {
		if _, err := c.read(5 * time.Millisecond); err != nil {
			return
		}
	}
}
