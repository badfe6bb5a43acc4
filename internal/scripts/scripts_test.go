package scripts_test

// Tests of the reentrant-lock scripts and of the runner, against a real
// redis-server. The fair-lock scripts are tested in fair_scripts_test.go.
//
// Every top-level test starts its own server and runs in parallel with the
// others; its subtests run one after the other on distinct lock names.
// Publications are observed on a raw PSUBSCRIBE connection (pattern
// subscribers do not count in PUBSUB NUMSUB, so the observer never changes
// what lock_handoff sees); a marker message published after the script marks
// the end of what the script could have published, so "nothing was
// published" is checked without sleeping.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/rueidis"

	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/internal/testredis"
)

func TestMain(m *testing.M) { testredis.Main(m) }

const (
	lease     = 30_000 // ms: the releasing/acquiring owner's lease
	leaseB    = 45_000 // ms: a receiving owner's lease, distinguishable from lease
	unlockMsg = "0"
	// pttlSlack is how far below the lease a freshly set PTTL may be read back.
	pttlSlack = 2_000
	// ioTimeout bounds every round trip of a test.
	ioTimeout = 5 * time.Second
)

// channel is the reentrant lock's unlock channel (and the fair lock's channel prefix).
func channel(name string) string { return "redisson_lock__channel:{" + name + "}" }

// env is one redis-server, a rueidis client on it and the runner under test.
type env struct {
	srv *testredis.Server
	rc  rueidis.Client
	r   *scripts.Redis
}

func newEnv(t *testing.T) *env {
	t.Helper()
	srv := testredis.New(t)
	rc, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{srv.Addr()}, DisableCache: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rc.Close) // runs before the server is stopped (cleanups run last-in first-out)
	return &env{srv: srv, rc: rc, r: scripts.NewRedis(rc)}
}

// aclRunner creates the ACL user name (password "pw") with rules and returns a
// runner on a client of that user's own; both are closed when the test ends.
func (e *env) aclRunner(t *testing.T, name string, rules ...string) *scripts.Redis {
	t.Helper()
	e.do(t, append([]string{"ACL", "SETUSER", name, "on", ">pw"}, rules...)...)
	rc, err := rueidis.NewClient(rueidis.ClientOption{
		InitAddress: []string{e.srv.Addr()}, Username: name, Password: "pw", DisableCache: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rc.Close)
	r := scripts.NewRedis(rc)
	t.Cleanup(r.Close) // before rc.Close (cleanups run last-in first-out)
	return r
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), ioTimeout)
	t.Cleanup(cancel)
	return ctx
}

// run runs one script through Runner.Run and fails the test on an error.
func (e *env) run(t *testing.T, id scripts.ID, keys []string, args ...string) scripts.Reply {
	t.Helper()
	rep, err := e.r.Run(ctxT(t), id, keys, args)
	if err != nil {
		t.Fatalf("%v %q %q: %v", id, keys, args, err)
	}
	return rep
}

// do sends a raw command over testredis's own connection.
func (e *env) do(t *testing.T, args ...string) string {
	t.Helper()
	out, err := e.srv.Do(args...)
	if err != nil {
		t.Fatalf("%q: %v", args, err)
	}
	return out
}

func (e *env) doInt(t *testing.T, args ...string) int64 {
	t.Helper()
	out := e.do(t, args...)
	n, err := strconv.ParseInt(out, 10, 64)
	if err != nil {
		t.Fatalf("%q: reply %q is not an integer", args, out)
	}
	return n
}

func (e *env) pttl(t *testing.T, key string) int64 {
	t.Helper()
	return e.doInt(t, "PTTL", key)
}

// wantPTTL checks that key's PTTL was just set to ms.
func (e *env) wantPTTL(t *testing.T, key string, ms int64) {
	t.Helper()
	if got := e.pttl(t, key); got <= ms-pttlSlack || got > ms {
		t.Errorf("PTTL %s = %d, want about %d", key, got, ms)
	}
}

// setHash replaces key with the hash described by spec ("A=2 B=1"; "" deletes the
// key) and gives it the PTTL pttl in ms (-1: no expiry).
func (e *env) setHash(t *testing.T, key, spec string, pttl int64) {
	t.Helper()
	e.do(t, "DEL", key)
	if spec == "" {
		return
	}
	args := []string{"HSET", key}
	for f := range strings.FieldsSeq(spec) {
		k, v, _ := strings.Cut(f, "=")
		args = append(args, k, v)
	}
	e.do(t, args...)
	if pttl >= 0 {
		e.do(t, "PEXPIRE", key, strconv.FormatInt(pttl, 10))
	}
}

// hash renders key's hash as "A=2 B=1" (fields sorted); "" when the key is absent.
func (e *env) hash(t *testing.T, key string) string {
	t.Helper()
	out := e.do(t, "HGETALL", key)
	if out == "" {
		return ""
	}
	kv := strings.Split(out, "\n")
	fields := make([]string, 0, len(kv)/2)
	for i := 0; i+1 < len(kv); i += 2 {
		fields = append(fields, kv[i]+"="+kv[i+1])
	}
	slices.Sort(fields)
	return strings.Join(fields, " ")
}

func (e *env) wantHash(t *testing.T, key, want string) {
	t.Helper()
	if got := e.hash(t, key); got != want {
		t.Errorf("hash %s = %q, want %q", key, got, want)
	}
}

// show renders a reply: "nil", "5", "[1 0 1]".
func show(r scripts.Reply) string {
	switch {
	case r.Nil:
		return "nil"
	case r.Ints != nil:
		return fmt.Sprint(r.Ints)
	default:
		return strconv.FormatInt(r.Int, 10)
	}
}

func wantReply(t *testing.T, what string, got scripts.Reply, want string) {
	t.Helper()
	if s := show(got); s != want {
		t.Errorf("%s replied %s, want %s", what, s, want)
	}
}

// wantIntIn checks an integer reply in (lo, hi] and returns it.
func wantIntIn(t *testing.T, what string, got scripts.Reply, lo, hi int64) int64 {
	t.Helper()
	if got.Nil || got.Ints != nil || got.Int <= lo || got.Int > hi {
		t.Errorf("%s replied %s, want an integer in (%d, %d]", what, show(got), lo, hi)
	}
	return got.Int
}

// ---- raw RESP connections for pub/sub ----

// conn is a raw RESP2 connection, used for subscriptions.
type conn struct {
	c net.Conn
	r *bufio.Reader
}

func (e *env) dial(t *testing.T) *conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", e.srv.Addr(), ioTimeout)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &conn{c: c, r: bufio.NewReader(c)}
}

func (c *conn) send(t *testing.T, args ...string) {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(&b, "$%d\r\n%s\r\n", len(a), a)
	}
	c.c.SetWriteDeadline(time.Now().Add(ioTimeout))
	if _, err := io.WriteString(c.c, b.String()); err != nil {
		t.Fatal(err)
	}
}

// recv reads one reply, which must be an array of strings and integers (the only
// replies a subscribed connection gets), within ioTimeout.
func (c *conn) recv(t *testing.T) []string {
	t.Helper()
	c.c.SetReadDeadline(time.Now().Add(ioTimeout))
	line := c.line(t)
	if line[0] != '*' {
		t.Fatalf("pub/sub connection: unexpected reply %q", line)
	}
	n, err := strconv.Atoi(line[1:])
	if err != nil {
		t.Fatalf("pub/sub connection: bad array header %q", line)
	}
	elems := make([]string, n)
	for i := range elems {
		switch h := c.line(t); h[0] {
		case ':', '+':
			elems[i] = h[1:]
		case '$':
			size, err := strconv.Atoi(h[1:])
			if err != nil || size < 0 {
				t.Fatalf("pub/sub connection: bad bulk header %q", h)
			}
			buf := make([]byte, size+2)
			if _, err := io.ReadFull(c.r, buf); err != nil {
				t.Fatalf("pub/sub connection: %v", err)
			}
			elems[i] = string(buf[:size])
		default:
			t.Fatalf("pub/sub connection: unexpected element %q", h)
		}
	}
	return elems
}

func (c *conn) line(t *testing.T) string {
	t.Helper()
	s, err := c.r.ReadString('\n')
	if err != nil {
		t.Fatalf("pub/sub connection: %v", err)
	}
	s = strings.TrimSuffix(s, "\r\n")
	if s == "" {
		t.Fatal("pub/sub connection: empty line")
	}
	return s
}

// subscribe opens a connection subscribed (SUBSCRIBE, counted by PUBSUB NUMSUB) to
// channel and returns once the subscription is active.
func (e *env) subscribe(t *testing.T, channel string) *conn {
	t.Helper()
	c := e.dial(t)
	c.send(t, "SUBSCRIBE", channel)
	if got := c.recv(t); len(got) != 3 || got[0] != "subscribe" || got[1] != channel {
		t.Fatalf("SUBSCRIBE %s: %q", channel, got)
	}
	return c
}

// watcher sees every message published on a channel whose name contains "{name}".
type watcher struct {
	e      *env
	c      *conn
	marker string
}

// watch starts watching the channels of lock name; the subscription is active
// when it returns.
func (e *env) watch(t *testing.T, name string) *watcher {
	t.Helper()
	c := e.dial(t)
	pattern := "*{" + name + "}*"
	c.send(t, "PSUBSCRIBE", pattern)
	if got := c.recv(t); len(got) != 3 || got[0] != "psubscribe" || got[1] != pattern {
		t.Fatalf("PSUBSCRIBE %s: %q", pattern, got)
	}
	return &watcher{e: e, c: c, marker: "test-marker:{" + name + "}"}
}

// published returns, as "channel=message", what was published on the watched
// channels since the last call (or since watch).
func (w *watcher) published(t *testing.T) []string {
	t.Helper()
	w.e.do(t, "PUBLISH", w.marker, "end")
	var got []string
	for {
		m := w.c.recv(t)
		if len(m) != 4 || m[0] != "pmessage" {
			t.Fatalf("watcher: unexpected push %q", m)
		}
		if m[2] == w.marker {
			return got
		}
		got = append(got, m[2]+"="+m[3])
	}
}

func (w *watcher) want(t *testing.T, want ...string) {
	t.Helper()
	if got := w.published(t); !slices.Equal(got, want) {
		t.Errorf("published %q, want %q", got, want)
	}
}

// wantUnlock checks that the unlock message "0" was published on key's unlock
// channel if published, and nothing otherwise.
func (w *watcher) wantUnlock(t *testing.T, key string, published bool) {
	t.Helper()
	if published {
		w.want(t, channel(key)+"=0")
	} else {
		w.want(t)
	}
}

// ---- the scripts' identities ----

func TestSources(t *testing.T) {
	t.Parallel()
	files := []string{
		"lock_acquire", "lock_release", "lock_release_owner", "lock_force_release", "lock_renew", "lock_handoff",
		"fair_acquire", "fair_release", "fair_leave", "fair_handoff", "fair_force_release", "lock_leave",
	}
	for i, name := range files {
		id := scripts.ID(i)
		if id.String() != name {
			t.Errorf("ID %d is %q, want %q", i, id, name)
		}
		src := scripts.Source(id)
		libName, libFunc := "", ""
		switch name {
		case "fair_acquire", "fair_release", "fair_leave", "fair_handoff", "fair_force_release":
			libName, libFunc = "fair_lib", "pass_on"
		case "lock_acquire", "lock_release", "lock_handoff", "lock_leave":
			libName, libFunc = "lock_lib", "grant_next"
		}
		if libName != "" {
			// These scripts start with their shared functions.
			lib, rest, ok := strings.Cut(src, "\n-- "+name+".lua:")
			if !ok || !strings.HasPrefix(lib, "-- "+libName+".lua:") || !strings.Contains(lib, "local function "+libFunc+"(") {
				t.Errorf("Source(%v) is not %s.lua followed by its file", id, libName)
			}
			src = "-- " + name + ".lua:" + rest
		}
		if !strings.HasPrefix(src, "-- "+name+".lua:") {
			t.Errorf("Source(%v) does not start with its file's header", id)
		}
	}
}

// ---- lock_acquire ----

// acquireCase is one lock_acquire case: the lock's hash before the call and
// what the call must answer and leave.
type acquireCase struct {
	name      string
	hash      string // the lock's hash before the call ("" = free)
	pttl      int64  // its PTTL before the call (-1: none)
	owner     string
	wantMin   int64 // for a PTTL reply: the reply is in (wantMin, wantMax]
	wantMax   int64
	wantNil   bool
	wantHash  string
	wantLease bool // the PTTL was (re)set to the lease
}

var acquireCases = []acquireCase{
	{name: "free", owner: "c:1", wantNil: true, wantHash: "c:1=1", wantLease: true},
	{name: "reentry", hash: "c:1=1", pttl: 1_000, owner: "c:1", wantNil: true, wantHash: "c:1=2", wantLease: true},
	{name: "other owner", hash: "c:1=1", pttl: 20_000, owner: "c:2",
		wantMin: 20_000 - pttlSlack, wantMax: 20_000, wantHash: "c:1=1"},
	{name: "other owner, no expiry", hash: "c:1=1", pttl: -1, owner: "c:2",
		wantMin: -2, wantMax: -1, wantHash: "c:1=1"},
	{name: "other owner besides a Java owner field", hash: "uuid-java:77=3", pttl: 20_000, owner: "c:1",
		wantMin: 20_000 - pttlSlack, wantMax: 20_000, wantHash: "uuid-java:77=3"},
}

// check checks a lock_acquire reply and what the call left on key.
func (tc acquireCase) check(t *testing.T, e *env, key string, rep scripts.Reply) {
	t.Helper()
	if tc.wantNil {
		wantReply(t, "lock_acquire", rep, "nil")
	} else {
		wantIntIn(t, "lock_acquire", rep, tc.wantMin, tc.wantMax)
	}
	e.wantHash(t, key, tc.wantHash)
	if tc.wantLease {
		e.wantPTTL(t, key, lease)
	}
}

func TestLockAcquire(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for i, tc := range acquireCases {
		t.Run(tc.name, func(t *testing.T) {
			key := fmt.Sprintf("acq%d", i)
			e.setHash(t, key, tc.hash, tc.pttl)
			tc.check(t, e, key, e.run(t, scripts.LockAcquire, []string{key}, strconv.Itoa(lease), tc.owner))
		})
	}
}

// ---- lock_release ----

func TestLockRelease(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cases := []struct {
		name      string
		hash      string
		owner     string
		want      string
		wantHash  string
		wantLease bool   // PEXPIRE re-applied
		wantPub   bool   // "0" published on the lock's channel
		keep      string // ARGV[7], the count the caller expects to keep ("": absent)
	}{
		{name: "free", owner: "c:1", want: "nil"},
		{name: "not owner", hash: "c:2=1", owner: "c:1", want: "nil", wantHash: "c:2=1"},
		{name: "count 2", hash: "c:1=2", owner: "c:1", want: "0", wantHash: "c:1=1", wantLease: true},
		{name: "count 1", hash: "c:1=1", owner: "c:1", want: "1", wantPub: true},
		{name: "count 2, keeping 1", hash: "c:1=2", owner: "c:1", keep: "1", want: "0", wantHash: "c:1=1",
			wantLease: true},
		// A retry of that release, whose first try ran: nothing more goes.
		{name: "count 1, keeping 1", hash: "c:1=1", owner: "c:1", keep: "1", want: "0", wantHash: "c:1=1",
			wantLease: true},
		{name: "count 3 (a surplus), keeping 1", hash: "c:1=3", owner: "c:1", keep: "1", want: "0",
			wantHash: "c:1=2", wantLease: true},
		{name: "count 1, keeping 0", hash: "c:1=1", owner: "c:1", keep: "0", want: "1", wantPub: true},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			key := fmt.Sprintf("rel%d", i)
			e.setHash(t, key, tc.hash, 1_000)
			w := e.watch(t, key)
			args := []string{unlockMsg, strconv.Itoa(lease), tc.owner}
			if tc.keep != "" {
				args = append(args, "", "1", "0", tc.keep) // ARGV[4-6] count only with KEYS[3]
			}
			rep := e.run(t, scripts.LockRelease, []string{key, channel(key)}, args...)
			wantReply(t, "lock_release", rep, tc.want)
			e.wantHash(t, key, tc.wantHash)
			if tc.wantLease {
				e.wantPTTL(t, key, lease)
			} else if tc.wantHash != "" {
				if p := e.pttl(t, key); p > 1_000 {
					t.Errorf("PTTL %d: the lease was re-applied to a lock the caller does not hold", p)
				}
			}
			w.wantUnlock(t, key, tc.wantPub)
		})
	}
	// A count that is not an integer fails as Redisson's unlock does (HINCRBY's
	// error), and the lock stays as it was.
	t.Run("count not an integer", func(t *testing.T) {
		e.setHash(t, "rel-float", "c:1=1.5", 1_000)
		if _, err := e.r.Run(ctxT(t), scripts.LockRelease, []string{"rel-float", channel("rel-float")},
			[]string{unlockMsg, strconv.Itoa(lease), "c:1"}); err == nil || !strings.Contains(err.Error(), "not an integer") {
			t.Fatalf("lock_release on count 1.5: %v, want HINCRBY's error", err)
		}
		e.wantHash(t, "rel-float", "c:1=1.5")
	})
}

// ---- lock_release_owner ----

func TestLockReleaseOwner(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cases := []struct {
		name     string
		hash     string
		queue    []string // fair variant when non-nil: KEYS[3] is this queue
		owner    string
		drop     string
		want     string
		wantHash string
		wantPub  string // "" none; "lock": the lock's channel; else the queue head woken
		keep     string // ARGV[4], the count the caller expects to keep ("": absent)
	}{
		{name: "drop 1 of 2, keeping 1", hash: "c:1=2", owner: "c:1", drop: "1", keep: "1", want: "0", wantHash: "c:1=1"},
		// A retry of that give-back, whose first try ran: nothing more goes.
		{name: "drop 1 of 1, keeping 1", hash: "c:1=1", owner: "c:1", drop: "1", keep: "1", want: "0", wantHash: "c:1=1"},
		{name: "drop 2 of 2, keeping 1", hash: "c:1=2", owner: "c:1", drop: "2", keep: "1", want: "0", wantHash: "c:1=1"},
		{name: "drop 1 of 1, keeping 0", hash: "c:1=1", owner: "c:1", drop: "1", keep: "0", want: "1", wantPub: "lock"},
		{name: "drop 1 of 3", hash: "c:1=3", owner: "c:1", drop: "1", want: "0", wantHash: "c:1=2"},
		{name: "drop 1 of 1", hash: "c:1=1", owner: "c:1", drop: "1", want: "1", wantPub: "lock"},
		{name: "drop 2 of 2", hash: "c:1=2", owner: "c:1", drop: "2", want: "1", wantPub: "lock"},
		{name: "drop more than held", hash: "c:1=2", owner: "c:1", drop: "5", want: "1", wantPub: "lock"},
		{name: "drop all (0)", hash: "c:1=3", owner: "c:1", drop: "0", want: "1", wantPub: "lock"},
		{name: "not held, free", owner: "c:1", drop: "0", want: "-1"},
		{name: "not held, other owner", hash: "c:2=1", owner: "c:1", drop: "0", want: "-1", wantHash: "c:2=1"},
		{name: "fair, wakes only the head", hash: "c:1=1", queue: []string{"c:7", "c:8"}, owner: "c:1", drop: "0",
			want: "1", wantPub: "c:7"},
		{name: "fair, drop 1 of 2", hash: "c:1=2", queue: []string{"c:7"}, owner: "c:1", drop: "1",
			want: "0", wantHash: "c:1=1"},
		{name: "fair, empty queue", hash: "c:1=1", queue: []string{}, owner: "c:1", drop: "0", want: "1"},
		{name: "fair, not held", hash: "c:2=1", queue: []string{"c:7"}, owner: "c:1", drop: "0",
			want: "-1", wantHash: "c:2=1"},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			key := fmt.Sprintf("relown%d", i)
			e.setHash(t, key, tc.hash, lease)
			keys := []string{key, channel(key)}
			if tc.queue != nil {
				q := "redisson_lock_queue:{" + key + "}"
				keys = append(keys, q)
				if len(tc.queue) > 0 {
					e.do(t, append([]string{"RPUSH", q}, tc.queue...)...)
				}
			}
			w := e.watch(t, key)
			args := []string{unlockMsg, tc.owner, tc.drop}
			if tc.keep != "" {
				args = append(args, tc.keep)
			}
			rep := e.run(t, scripts.LockReleaseOwner, keys, args...)
			wantReply(t, "lock_release_owner", rep, tc.want)
			e.wantHash(t, key, tc.wantHash)
			switch tc.wantPub {
			case "":
				w.want(t)
			case "lock":
				w.want(t, channel(key)+"=0")
			default:
				w.want(t, channel(key)+":"+tc.wantPub+"=0")
			}
			if len(tc.queue) > 0 {
				if got := e.do(t, "LRANGE", keys[2], "0", "-1"); got != strings.Join(tc.queue, "\n") {
					t.Errorf("queue = %q, want it unchanged", got)
				}
			}
		})
	}
}

// ---- lock_force_release ----

func TestLockForceRelease(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for i, tc := range []struct {
		name, hash, want string
		wantPub          bool
	}{
		{name: "held", hash: "c:1=2", want: "1", wantPub: true},
		{name: "held by a Java owner", hash: "uuid-java:77=1", want: "1", wantPub: true},
		{name: "absent", want: "0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			key := fmt.Sprintf("force%d", i)
			e.setHash(t, key, tc.hash, lease)
			w := e.watch(t, key)
			rep := e.run(t, scripts.LockForceRelease, []string{key, channel(key)}, unlockMsg)
			wantReply(t, "lock_force_release", rep, tc.want)
			if n := e.doInt(t, "EXISTS", key); n != 0 {
				t.Error("the lock still exists")
			}
			w.wantUnlock(t, key, tc.wantPub)
		})
	}
}

// ---- lock_renew ----

func TestLockRenew(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	const renewed = 60_000

	t.Run("one lock lost among three", func(t *testing.T) {
		e.setHash(t, "ren1", "c:1=1", 1_000)
		e.setHash(t, "ren2", "c:9=1", 1_000) // held by someone else
		e.setHash(t, "ren3", "c:3=2", 1_000)
		rep := e.run(t, scripts.LockRenew, []string{"ren1", "ren2", "ren3"},
			strconv.Itoa(renewed), "c:1", "c:2", "c:3")
		wantReply(t, "lock_renew", rep, "[1 0 1]")
		e.wantPTTL(t, "ren1", renewed)
		e.wantPTTL(t, "ren3", renewed)
		if p := e.pttl(t, "ren2"); p > 1_000 {
			t.Errorf("PTTL ren2 = %d: another owner's lock was extended", p)
		}
		e.wantHash(t, "ren1", "c:1=1")
		e.wantHash(t, "ren2", "c:9=1")
		e.wantHash(t, "ren3", "c:3=2")
	})
	t.Run("expired lock", func(t *testing.T) {
		e.setHash(t, "ren4", "c:1=1", 1_000)
		rep := e.run(t, scripts.LockRenew, []string{"ren-gone", "ren4"}, strconv.Itoa(renewed), "c:1", "c:1")
		wantReply(t, "lock_renew", rep, "[0 1]")
		if n := e.doInt(t, "EXISTS", "ren-gone"); n != 0 {
			t.Error("renewal created a lock")
		}
		e.wantPTTL(t, "ren4", renewed)
	})
}

// ---- lock_handoff ----

func TestLockHandoff(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	const (
		from = "c:1"
		to   = "c:2"
	)
	cases := []struct {
		name      string
		hash      string
		bound     string // ARGV[5]
		retry     bool   // ARGV[7] = "1"
		listeners int    // SUBSCRIBE connections on the unlock channel (the caller's included)
		ask       bool   // ARGV[8..12]: the caller's id, it listens, no registration, ask about listeners
		selfOff   bool   // with ask: ARGV[9] = "0" (the caller does not count itself as a listener)
		want      string
		wantHash  string
		wantPTTL  int64 // 0: not checked
		wantPub   bool
	}{
		{name: "not owner", hash: "c:9=1", bound: "0", want: "nil", wantHash: "c:9=1"},
		{name: "free", bound: "0", want: "nil"},
		{name: "still held", hash: from + "=2", bound: "0", want: "0", wantHash: from + "=1", wantPTTL: lease},
		{name: "still held at the bound", hash: from + "=2", bound: "1", listeners: 2,
			want: "0", wantHash: from + "=1", wantPTTL: lease},
		{name: "handed off", hash: from + "=1", bound: "0", want: "2", wantHash: to + "=1", wantPTTL: leaseB},
		{name: "handed off below the bound despite other listeners", hash: from + "=1", bound: "0", listeners: 3,
			want: "2", wantHash: to + "=1", wantPTTL: leaseB},
		{name: "bound, another client listens", hash: from + "=1", bound: "1", listeners: 2,
			want: "1", wantPub: true},
		{name: "bound, only the caller listens", hash: from + "=1", bound: "1", listeners: 1,
			want: "2", wantHash: to + "=1", wantPTTL: leaseB},
		{name: "bound, nobody listens", hash: from + "=1", bound: "1",
			want: "2", wantHash: to + "=1", wantPTTL: leaseB},
		{name: "retry, the first try ran", hash: to + "=1", bound: "0", retry: true,
			want: "2", wantHash: to + "=1"},
		{name: "retry, the first try did not run and the field is gone", bound: "0", retry: true, want: "nil"},
		{name: "retry, another owner holds", hash: "c:9=1", bound: "0", retry: true, want: "nil", wantHash: "c:9=1"},
		{name: "retry, the first try did not run", hash: from + "=1", bound: "0", retry: true,
			want: "2", wantHash: to + "=1", wantPTTL: leaseB},
		{name: "not a retry, the receiver's field there", hash: to + "=1", bound: "0", want: "nil", wantHash: to + "=1"},
		{name: "asked, only the caller listens", hash: from + "=1", bound: "0", listeners: 1, ask: true,
			want: "2", wantHash: to + "=1", wantPTTL: leaseB},
		{name: "asked, nobody listens", hash: from + "=1", bound: "0", ask: true,
			want: "2", wantHash: to + "=1", wantPTTL: leaseB},
		{name: "asked, another client listens", hash: from + "=1", bound: "0", listeners: 2, ask: true,
			want: "5", wantHash: to + "=1", wantPTTL: leaseB},
		{name: "asked, one listener and the caller says it does not listen", hash: from + "=1", bound: "0", listeners: 1, ask: true, selfOff: true,
			want: "5", wantHash: to + "=1", wantPTTL: leaseB},
		{name: "asked, still held", hash: from + "=2", bound: "0", listeners: 2, ask: true,
			want: "0", wantHash: from + "=1", wantPTTL: lease},
		{name: "asked at the bound, another client listens", hash: from + "=1", bound: "1", listeners: 2, ask: true,
			want: "1", wantPub: true},
		{name: "asked at the bound, only the caller listens", hash: from + "=1", bound: "1", listeners: 1, ask: true,
			want: "2", wantHash: to + "=1", wantPTTL: leaseB},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			key := fmt.Sprintf("hand%d", i)
			e.setHash(t, key, tc.hash, 1_000)
			for range tc.listeners {
				e.subscribe(t, channel(key))
			}
			w := e.watch(t, key)
			retry := "0"
			if tc.retry {
				retry = "1"
			}
			args := []string{from, strconv.Itoa(lease), to, strconv.Itoa(leaseB), tc.bound, unlockMsg, retry}
			if tc.ask {
				self := "1"
				if tc.selfOff {
					self = "0"
				}
				args = append(args, "c", self, "", "", "1")
			}
			rep := e.run(t, scripts.LockHandoff, []string{key, channel(key)}, args...)
			wantReply(t, "lock_handoff", rep, tc.want)
			e.wantHash(t, key, tc.wantHash)
			if tc.wantPTTL != 0 {
				e.wantPTTL(t, key, tc.wantPTTL)
			}
			w.wantUnlock(t, key, tc.wantPub)
		})
	}
}

// ---- the runner ----

func TestRunBatch(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	L := strconv.Itoa(lease)

	// check compares results with wants ("nil", "5", "[1 0]", "error" (a Redis error
	// reply), "reordered" (ErrReordered), or "pttl": an integer in (0, lease]).
	check := func(t *testing.T, res []scripts.Result, want []string) {
		t.Helper()
		if len(res) != len(want) {
			t.Fatalf("%d results, want %d", len(res), len(want))
		}
		for i, r := range res {
			switch want[i] {
			case "reordered":
				if !errors.Is(r.Err, scripts.ErrReordered) {
					t.Errorf("result %d: err %v, want ErrReordered", i, r.Err)
				}
			case "error":
				if _, ok := rueidis.IsRedisErr(r.Err); !ok {
					t.Errorf("result %d: err %v, want a Redis error reply", i, r.Err)
				}
			case "pttl":
				if r.Err != nil {
					t.Errorf("result %d: %v", i, r.Err)
				} else {
					wantIntIn(t, fmt.Sprintf("call %d", i), r.Reply, 0, lease)
				}
			default:
				if r.Err != nil {
					t.Errorf("result %d: %v", i, r.Err)
				} else {
					wantReply(t, fmt.Sprintf("call %d", i), r.Reply, want[i])
				}
			}
		}
	}
	// mixed returns a batch of different scripts on lock k (and fair lock k+"f"),
	// whose results depend on running in order, and what they must return.
	mixed := func(k string) ([]scripts.Call, []string) {
		f := k + "f"
		fk := []string{f, "redisson_lock_queue:{" + f + "}", "redisson_lock_timeout:{" + f + "}", "leash_lock_grants:{" + f + "}"}
		fkr := []string{fk[0], fk[1], fk[2], channel(f), fk[3]}
		now := strconv.FormatInt(time.Now().UnixMilli(), 10)
		return []scripts.Call{
				{ID: scripts.LockAcquire, Keys: []string{k}, Args: []string{L, "c:1"}},
				{ID: scripts.LockAcquire, Keys: []string{k}, Args: []string{L, "c:1"}},
				{ID: scripts.LockAcquire, Keys: []string{k}, Args: []string{L, "c:2"}},
				{ID: scripts.LockRenew, Keys: []string{k, k + "-none"}, Args: []string{L, "c:1", "c:1"}},
				{ID: scripts.LockAcquire, Keys: []string{k + "-str"}, Args: []string{L, "c:1"}}, // WRONGTYPE
				{ID: scripts.LockRelease, Keys: []string{k, channel(k)}, Args: []string{unlockMsg, L, "c:2"}},
				{ID: scripts.LockRelease, Keys: []string{k, channel(k)}, Args: []string{unlockMsg, L, "c:1"}},
				{ID: scripts.LockRelease, Keys: []string{k, channel(k)}, Args: []string{unlockMsg, L, "c:1"}},
				{ID: scripts.FairAcquire, Keys: fk, Args: []string{L, "c:1", "5000", now, "0"}},
				{ID: scripts.FairAcquire, Keys: fk, Args: []string{L, "c:2", "5000", now, "1"}},
				{ID: scripts.FairRelease, Keys: fkr, Args: []string{unlockMsg, L, "c:1", now, "5000"}},
				{ID: scripts.LockForceRelease, Keys: []string{k, channel(k)}, Args: []string{unlockMsg}},
			}, []string{
				"nil", "nil", "pttl", "[1 0]", "error", "nil", "0", "1",
				"nil", "1", "2", "0",
			}
	}

	t.Run("mixed scripts, in order", func(t *testing.T) {
		e.do(t, "SET", "b1-str", "x")
		calls, want := mixed("b1")
		check(t, e.r.RunBatch(ctxT(t), calls, nil), want)
	})
	t.Run("a shorter call after a longer one sees only its own keys and arguments", func(t *testing.T) {
		// The merged script reuses one KEYS and one ARGV table: what a longer call
		// left at the end must read as absent (optional arguments, #KEYS).
		f := "b9f"
		fk := []string{f, "redisson_lock_queue:{" + f + "}", "redisson_lock_timeout:{" + f + "}", "leash_lock_grants:{" + f + "}"}
		now := strconv.FormatInt(time.Now().UnixMilli(), 10)
		e.setHash(t, f, "c:7=1", lease)
		e.setHash(t, "b9", "c:1=1", lease)
		calls := []scripts.Call{
			// ARGV[7] = "1": c:7's hold is claimed as an unheard grant, count stays 1.
			{ID: scripts.FairAcquire, Keys: fk, Args: []string{L, "c:7", "5000", now, "0", "", "1"}},
			// One key after four: #KEYS must be 1, or the reply has four elements.
			{ID: scripts.LockRenew, Keys: []string{"b9"}, Args: []string{L, "c:1"}},
			// No ARGV[7]: a re-entry, count 2.
			{ID: scripts.FairAcquire, Keys: fk, Args: []string{L, "c:7", "5000", now, "0"}},
		}
		check(t, e.r.RunBatch(ctxT(t), calls, nil), []string{"nil", "[1]", "nil"})
		e.wantHash(t, f, "c:7=2")
	})
	t.Run("results in the array of out", func(t *testing.T) {
		out := make([]scripts.Result, 1, 64)
		out[0].Err = errors.New("stale")
		e.do(t, "SET", "b10-str", "x")
		calls, want := mixed("b10")
		res := e.r.RunBatch(ctxT(t), calls, out)
		if &res[0] != &out[:1][0] {
			t.Error("the results are not in out's array")
		}
		check(t, res, want) // every result set, out's old one included
	})
	t.Run("empty", func(t *testing.T) {
		if res := e.r.RunBatch(ctxT(t), nil, nil); len(res) != 0 {
			t.Errorf("%d results for no calls", len(res))
		}
	})
	t.Run("after SCRIPT FLUSH", func(t *testing.T) {
		e.do(t, "SET", "b2-str", "x")
		e.do(t, "SET", "b3-str", "x")
		e.do(t, "SCRIPT", "FLUSH")
		if err := e.srv.ResetStats(); err != nil {
			t.Fatal(err)
		}
		calls, want := mixed("b2")
		check(t, e.r.RunBatch(ctxT(t), calls, nil), want)
		stats, err := e.srv.CommandStats()
		if err != nil {
			t.Fatal(err)
		}
		// The merged call met NOSCRIPT: all scripts (and the multi script) were
		// loaded in one write, and the call went again by SHA.
		if stats["eval"] != 0 || stats["script|load"] != int64(scripts.NumScripts+1) || stats["evalsha"] != 2 {
			t.Errorf("after SCRIPT FLUSH: %d EVAL, %d SCRIPT LOAD, %d EVALSHA; want 0, %d, 2",
				stats["eval"], stats["script|load"], stats["evalsha"], scripts.NumScripts+1)
		}
		// The scripts are loaded: the next batch goes by SHA alone.
		if err := e.srv.ResetStats(); err != nil {
			t.Fatal(err)
		}
		calls, want = mixed("b3")
		check(t, e.r.RunBatch(ctxT(t), calls, nil), want)
		if stats, err = e.srv.CommandStats(); err != nil {
			t.Fatal(err)
		}
		if stats["eval"] != 0 || stats["evalsha"] != 1 {
			t.Errorf("second batch: %d EVAL, %d EVALSHA; want 0 and 1 (one merged call)", stats["eval"], stats["evalsha"])
		}
	})
	t.Run("partial NOSCRIPT", func(t *testing.T) {
		// A batch of MaxMerged+1 calls goes as two commands: the multi script with
		// the first MaxMerged calls, then the last call alone, by its own script's
		// SHA. After SCRIPT FLUSH only lock_acquire is loaded again, so the last unit
		// (an acquire of b4c) runs while the first (the multi script) meets NOSCRIPT.
		// The first unit holds b4c's release, overtaken by that acquire: it is not
		// sent again but answered ErrReordered, so the two never run out of order.
		e.do(t, "SCRIPT", "FLUSH")
		e.run(t, scripts.LockAcquire, []string{"b4-warm"}, L, "c:1")
		e.setHash(t, "b4c", "c:3=2", lease)
		var calls []scripts.Call
		var want []string
		for i := range scripts.MaxMerged - 1 {
			calls = append(calls, scripts.Call{ID: scripts.LockRenew, Keys: []string{fmt.Sprintf("b4-none%d", i)}, Args: []string{L, "c:9"}})
			want = append(want, "reordered")
		}
		calls = append(calls,
			scripts.Call{ID: scripts.LockRelease, Keys: []string{"b4c", channel("b4c")}, Args: []string{unlockMsg, L, "c:3"}},
			scripts.Call{ID: scripts.LockAcquire, Keys: []string{"b4c"}, Args: []string{L, "c:4"}})
		want = append(want, "reordered", "pttl")
		// The renewals share no key with the acquire, but they are in the overtaken
		// unit: a unit is sent again whole or not at all.
		if err := e.srv.ResetStats(); err != nil {
			t.Fatal(err)
		}
		check(t, e.r.RunBatch(ctxT(t), calls, nil), want)
		stats, err := e.srv.CommandStats()
		if err != nil {
			t.Fatal(err)
		}
		if stats["eval"] != 0 || stats["script|load"] != int64(scripts.NumScripts+1) {
			t.Errorf("%d EVAL, %d SCRIPT LOAD; want 0 and %d", stats["eval"], stats["script|load"], scripts.NumScripts+1)
		}
		e.wantHash(t, "b4c", "c:3=2") // the release did not run after the acquire

		// Without an overtaking unit, a unit that met NOSCRIPT goes again.
		e.do(t, "SCRIPT", "FLUSH")
		e.run(t, scripts.LockAcquire, []string{"b4-warm"}, L, "c:1")
		calls = calls[:scripts.MaxMerged]
		calls = append(calls, scripts.Call{ID: scripts.LockAcquire, Keys: []string{"b4d"}, Args: []string{L, "c:4"}})
		want = want[:0]
		for range scripts.MaxMerged - 1 {
			want = append(want, "[0]")
		}
		want = append(want, "0", "nil")
		check(t, e.r.RunBatch(ctxT(t), calls, nil), want)
		e.wantHash(t, "b4c", "c:3=1")
		e.wantHash(t, "b4d", "c:4=1")
	})
	t.Run("merged calls stay small", func(t *testing.T) {
		// Three renewal calls of MaxMergedKeys/2 locks each: two go merged, the
		// third alone would push a merged call past MaxMergedKeys, so it is a second
		// command. 2*MaxMerged+1 one-key calls make three commands (the last alone).
		var calls []scripts.Call
		var want []string
		const locks = scripts.MaxMergedKeys / 2
		for c := range 3 {
			keys, args := make([]string, locks), []string{L}
			for i := range keys {
				keys[i] = fmt.Sprintf("b7-%d-%d", c, i)
				args = append(args, "c:1")
			}
			calls = append(calls, scripts.Call{ID: scripts.LockRenew, Keys: keys, Args: args})
			want = append(want, "["+strings.TrimSpace(strings.Repeat("0 ", locks))+"]")
		}
		for _, n := range []int{3, 2*scripts.MaxMerged + 1} {
			for len(calls) < n {
				calls = append(calls, scripts.Call{ID: scripts.LockAcquire, Keys: []string{fmt.Sprintf("b7-%d", len(calls))}, Args: []string{L, "c:1"}})
				want = append(want, "nil")
			}
			if err := e.srv.ResetStats(); err != nil {
				t.Fatal(err)
			}
			check(t, e.r.RunBatch(ctxT(t), calls, nil), want)
			stats, err := e.srv.CommandStats()
			if err != nil {
				t.Fatal(err)
			}
			if wantCmds := map[int]int64{3: 2, 2*scripts.MaxMerged + 1: 3}[n]; stats["evalsha"] != wantCmds {
				t.Errorf("%d calls: %d EVALSHA, want %d", n, stats["evalsha"], wantCmds)
			}
			calls, want = calls[3:], want[3:]
		}
	})
	t.Run("merged call: a failing call does not stop the others", func(t *testing.T) {
		e.do(t, "SET", "b6-str", "x")
		calls := []scripts.Call{
			{ID: scripts.LockAcquire, Keys: []string{"b6"}, Args: []string{L, "c:1"}},
			{ID: scripts.LockAcquire, Keys: []string{"b6-str"}, Args: []string{L, "c:1"}}, // WRONGTYPE
			{ID: scripts.LockAcquire, Keys: []string{"b6"}, Args: []string{"not-a-number", "c:1"}},
			{ID: scripts.LockRelease, Keys: []string{"b6", channel("b6")}, Args: []string{unlockMsg, L, "c:1"}},
		}
		check(t, e.r.RunBatch(ctxT(t), calls, nil), []string{"nil", "error", "error", "0"})
	})
	t.Run("Run after SCRIPT FLUSH", func(t *testing.T) {
		wantReply(t, "lock_acquire", e.run(t, scripts.LockAcquire, []string{"b5"}, L, "c:1"), "nil")
		e.do(t, "SCRIPT", "FLUSH")
		wantReply(t, "lock_release", e.run(t, scripts.LockRelease, []string{"b5", channel("b5")}, unlockMsg, L, "c:1"), "1")
		e.do(t, "SCRIPT", "FLUSH")
		wantReply(t, "lock_renew", e.run(t, scripts.LockRenew, []string{"b5"}, L, "c:1"), "[0]")
	})
	t.Run("RunLone: its own connection, NOSCRIPT, a restart, Close", func(t *testing.T) {
		// A separate runner on its own client, so the restart below does not
		// disturb the other subtests' connection, and Close is checked.
		srv := testredis.New(t)
		rc, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{srv.Addr()}, DisableCache: true})
		if err != nil {
			t.Fatal(err)
		}
		defer rc.Close()
		r := scripts.NewRedis(rc)
		lone := func(what string, id scripts.ID, keys []string, args []string, want string) {
			t.Helper()
			rep, err := r.RunLone(ctxT(t), id, keys, args)
			if err != nil {
				t.Fatalf("%s: %v", what, err)
			}
			wantReply(t, what, rep, want)
		}
		lone("acquire", scripts.LockAcquire, []string{"b8"}, []string{L, "c:1"}, "nil")
		list, err := srv.Do("CLIENT", "LIST")
		if err != nil {
			t.Fatal(err)
		}
		if n := strings.Count(strings.TrimSpace(list), "\n") + 1; n < 2 {
			t.Errorf("%d connections after a lone call, want the shared one and RunLone's own", n)
		}
		if _, err := srv.Do("SCRIPT", "FLUSH"); err != nil {
			t.Fatal(err)
		}
		lone("reentry after SCRIPT FLUSH", scripts.LockAcquire, []string{"b8"}, []string{L, "c:1"}, "nil")
		if err := srv.Restart(); err != nil {
			t.Fatal(err)
		}
		// The first call after a restart may meet the dead connection; the one
		// after it must succeed on a fresh one.
		if _, err := r.RunLone(ctxT(t), scripts.LockAcquire, []string{"b9"}, []string{L, "c:1"}); err == nil {
			t.Log("the first lone call after the restart succeeded")
		}
		lone("acquire after a restart", scripts.LockAcquire, []string{"b10"}, []string{L, "c:1"}, "nil")
		// The shared connection meets the restart too (once): use it up first.
		rc.Do(ctxT(t), rc.B().Ping().Build())
		r.Close()
		lone("after Close (shared connection)", scripts.LockAcquire, []string{"b10"}, []string{L, "c:1"}, "nil")
	})
	t.Run("Run error reply", func(t *testing.T) {
		e.do(t, "SET", "b6", "x")
		_, err := e.r.Run(ctxT(t), scripts.LockAcquire, []string{"b6"}, []string{L, "c:1"})
		if _, ok := rueidis.IsRedisErr(err); !ok {
			t.Errorf("lock_acquire on a string key: err %v, want a Redis error reply", err)
		}
		var re *rueidis.RedisError
		if !errors.As(err, &re) {
			t.Errorf("err %T is not a *rueidis.RedisError", err)
		}
	})
}
