package testredis

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestMain(m *testing.M) { Main(m) }

// eventually polls cond until it holds or timeout passes.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		<-tick.C
	}
}

func mustDo(t *testing.T, s *Server, args ...string) string {
	t.Helper()
	got, err := s.Do(args...)
	if err != nil {
		t.Fatalf("Do(%q): %v", args, err)
	}
	return got
}

func doWithin(s *Server, d time.Duration, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	return s.DoContext(ctx, args...)
}

func TestStartAndPing(t *testing.T) {
	t.Parallel()
	s := New(t)
	if got := mustDo(t, s, "PING"); got != "PONG" {
		t.Fatalf("PING = %q, want PONG", got)
	}
	if want := "127.0.0.1:" + strconv.Itoa(s.Port()); s.Addr() != want {
		t.Fatalf("Addr() = %q, want %q", s.Addr(), want)
	}
	if s.Port() == 6379 || s.Port() <= 0 {
		t.Fatalf("Port() = %d", s.Port())
	}
	info, err := s.Info("server")
	if err != nil {
		t.Fatal(err)
	}
	if got, want := info["process_id"], strconv.Itoa(s.PID()); got != want {
		t.Fatalf("INFO process_id = %q, PID() = %s", got, want)
	}
	if got, want := info["tcp_port"], strconv.Itoa(s.Port()); got != want {
		t.Fatalf("INFO tcp_port = %q, want %s", got, want)
	}
	// The flags the package promises.
	for param, want := range map[string]string{
		"save":           "",
		"appendonly":     "no",
		"bind":           "127.0.0.1",
		"protected-mode": "no",
		"daemonize":      "no",
		"dir":            s.dir,
	} {
		if got := mustDo(t, s, "CONFIG", "GET", param); got != param+"\n"+want {
			t.Errorf("CONFIG GET %s = %q, want value %q", param, got, want)
		}
	}
	if _, err := os.Stat(s.dir + "/redis.log"); err != nil {
		t.Errorf("log file: %v", err)
	}
}

func TestWithArgs(t *testing.T) {
	t.Parallel()
	s := New(t, WithArgs("--maxclients", "100"), WithArgs("--hz", "50"))
	if got := mustDo(t, s, "CONFIG", "GET", "maxclients"); got != "maxclients\n100" {
		t.Fatalf("CONFIG GET maxclients = %q", got)
	}
	if got := mustDo(t, s, "CONFIG", "GET", "hz"); got != "hz\n50" {
		t.Fatalf("CONFIG GET hz = %q", got)
	}
}

func TestDoRendering(t *testing.T) {
	t.Parallel()
	s := New(t)
	if got := mustDo(t, s, "SET", "k", "hello world"); got != "OK" {
		t.Fatalf("SET = %q", got)
	}
	if got := mustDo(t, s, "GET", "k"); got != "hello world" {
		t.Fatalf("GET = %q", got)
	}
	if got := mustDo(t, s, "GET", "missing"); got != "" {
		t.Fatalf("GET missing = %q", got)
	}
	if got := mustDo(t, s, "INCR", "n"); got != "1" {
		t.Fatalf("INCR = %q", got)
	}
	if got := mustDo(t, s, "RPUSH", "l", "a", "", "c"); got != "3" {
		t.Fatalf("RPUSH = %q", got)
	}
	if got := mustDo(t, s, "LRANGE", "l", "0", "-1"); got != "a\n\nc" {
		t.Fatalf("LRANGE = %q", got)
	}
	if got := mustDo(t, s, "LRANGE", "nothing", "0", "-1"); got != "" {
		t.Fatalf("LRANGE of missing key = %q", got)
	}
	// Binary-safe bulk strings.
	bin := "a\r\nb\x00c"
	mustDo(t, s, "SET", "bin", bin)
	if got := mustDo(t, s, "GET", "bin"); got != bin {
		t.Fatalf("GET bin = %q", got)
	}
	_, err := s.Do("NOSUCHCOMMAND", "x")
	var rerr redisError
	if !errors.As(err, &rerr) || !strings.HasPrefix(err.Error(), "ERR unknown command") {
		t.Fatalf("unknown command: err = %v (%T)", err, err)
	}
	if _, err := s.Do(); err == nil {
		t.Fatal("empty command: no error")
	}
}

func TestNewN(t *testing.T) {
	t.Parallel()
	servers := NewN(t, 3)
	if len(servers) != 3 {
		t.Fatalf("NewN returned %d servers", len(servers))
	}
	ports := map[int]bool{}
	pids := map[int]bool{}
	for i, s := range servers {
		ports[s.Port()] = true
		pids[s.PID()] = true
		// Each server is independent: a key set on one is not on another.
		mustDo(t, s, "SET", "who", strconv.Itoa(i))
	}
	if len(ports) != 3 || len(pids) != 3 {
		t.Fatalf("ports %v, pids %v: want 3 distinct of each", ports, pids)
	}
	for i, s := range servers {
		if got := mustDo(t, s, "PING"); got != "PONG" {
			t.Fatalf("server %d: PING = %q", i, got)
		}
		if got := mustDo(t, s, "GET", "who"); got != strconv.Itoa(i) {
			t.Fatalf("server %d: who = %q", i, got)
		}
	}
}

func TestKill(t *testing.T) {
	t.Parallel()
	s := New(t)
	pid := s.PID()
	if err := s.Kill(); err != nil {
		t.Fatal(err)
	}
	if _, err := doWithin(s, time.Second, "PING"); err == nil {
		t.Fatal("PING after Kill succeeded")
	}
	if s.PID() != 0 {
		t.Fatalf("PID() after Kill = %d, want 0", s.PID())
	}
	// The process is gone and reaped, not a zombie.
	if err := exec.Command("kill", "-0", strconv.Itoa(pid)).Run(); err == nil {
		t.Fatalf("process %d still exists after Kill", pid)
	}
	if err := s.Kill(); err != nil {
		t.Fatalf("second Kill: %v", err)
	}
	if err := s.Pause(); err == nil {
		t.Fatal("Pause of a killed server succeeded")
	}
}

func TestRestart(t *testing.T) {
	t.Parallel()
	s := New(t)
	port, pid := s.Port(), s.PID()
	mustDo(t, s, "SET", "k", "v")

	// Restart while running: killed first, comes back empty on the same port.
	if err := s.Restart(); err != nil {
		t.Fatal(err)
	}
	if s.Port() != port {
		t.Fatalf("port changed: %d -> %d", port, s.Port())
	}
	if s.PID() == pid || s.PID() == 0 {
		t.Fatalf("PID after Restart = %d (was %d)", s.PID(), pid)
	}
	if got := mustDo(t, s, "GET", "k"); got != "" {
		t.Fatalf("GET k after Restart = %q, want nil", got)
	}
	if got := mustDo(t, s, "DBSIZE"); got != "0" {
		t.Fatalf("DBSIZE after Restart = %q", got)
	}

	// Restart after a crash.
	mustDo(t, s, "SET", "k", "v")
	if err := s.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := s.Restart(); err != nil {
		t.Fatal(err)
	}
	if got := mustDo(t, s, "EXISTS", "k"); got != "0" {
		t.Fatalf("EXISTS k after Kill+Restart = %q", got)
	}
	if info, err := s.Info("server"); err != nil || info["tcp_port"] != strconv.Itoa(port) {
		t.Fatalf("INFO server after restart: %v, tcp_port %q", err, info["tcp_port"])
	}

	// Restart while paused.
	if err := s.Pause(); err != nil {
		t.Fatal(err)
	}
	if err := s.Restart(); err != nil {
		t.Fatal(err)
	}
	if got := mustDo(t, s, "PING"); got != "PONG" {
		t.Fatalf("PING after restart of a paused server = %q", got)
	}
}

func TestPauseResume(t *testing.T) {
	t.Parallel()
	s := New(t)
	if err := s.Pause(); err != nil {
		t.Fatal(err)
	}
	// SIGSTOP takes effect asynchronously; wait until the server stops
	// answering, then check that it stays silent.
	eventually(t, 5*time.Second, "paused server to stop answering", func() bool {
		_, err := doWithin(s, 50*time.Millisecond, "PING")
		return err != nil
	})
	_, err := doWithin(s, 200*time.Millisecond, "PING")
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("PING on a paused server: err = %v, want a deadline error", err)
	}
	if err := s.Resume(); err != nil {
		t.Fatal(err)
	}
	if got := mustDo(t, s, "PING"); got != "PONG" {
		t.Fatalf("PING after Resume = %q", got)
	}
}

func TestStopIdempotentAndConcurrent(t *testing.T) {
	t.Parallel()
	s, err := Start()
	if err != nil {
		t.Fatal(err)
	}
	pid, dir := s.PID(), s.dir
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Go(func() { errs[i] = s.Stop() })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	if err := s.Stop(); err != nil {
		t.Fatalf("Stop again: %v", err)
	}
	if _, err := doWithin(s, time.Second, "PING"); err == nil {
		t.Fatal("PING after Stop succeeded")
	}
	if err := exec.Command("kill", "-0", strconv.Itoa(pid)).Run(); err == nil {
		t.Fatalf("process %d still exists after Stop", pid)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("temp dir %s still there after Stop (err %v)", dir, err)
	}
	if err := s.Restart(); err == nil {
		t.Fatal("Restart after Stop succeeded")
	}
	if err := s.Kill(); err != nil {
		t.Fatalf("Kill after Stop: %v", err)
	}
	registry.Lock()
	_, tracked := registry.servers[s]
	registry.Unlock()
	if tracked {
		t.Fatal("stopped server still in the registry")
	}
}

func TestStopInAnyState(t *testing.T) {
	t.Parallel()

	t.Run("exited on its own", func(t *testing.T) {
		t.Parallel()
		s, err := Start()
		if err != nil {
			t.Fatal(err)
		}
		// The server closes the connection without replying.
		if _, err := s.Do("SHUTDOWN", "NOSAVE"); err == nil {
			t.Fatal("SHUTDOWN replied")
		}
		start := time.Now()
		if err := s.Stop(); err != nil {
			t.Fatal(err)
		}
		if d := time.Since(start); d > 2*time.Second {
			t.Fatalf("Stop of an exited server took %v", d)
		}
	})
	t.Run("paused", func(t *testing.T) {
		t.Parallel()
		s, err := Start()
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Pause(); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		if err := s.Stop(); err != nil {
			t.Fatal(err)
		}
		if d := time.Since(start); d > 2*time.Second {
			t.Fatalf("Stop of a paused server took %v (SIGCONT not sent?)", d)
		}
	})
	t.Run("killed", func(t *testing.T) {
		t.Parallel()
		s, err := Start()
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Kill(); err != nil {
			t.Fatal(err)
		}
		if err := s.Stop(); err != nil {
			t.Fatal(err)
		}
	})
}

func TestCommandStats(t *testing.T) {
	t.Parallel()
	s := New(t)
	for range 2 {
		mustDo(t, s, "PING")
	}
	if err := s.ResetStats(); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		mustDo(t, s, "PING")
	}
	mustDo(t, s, "SET", "a", "1")
	mustDo(t, s, "EVAL", "return 1", "0")
	mustDo(t, s, "PUBLISH", "ch", "msg")
	stats, err := s.CommandStats()
	if err != nil {
		t.Fatal(err)
	}
	for cmd, want := range map[string]int64{"ping": 3, "set": 1, "eval": 1, "publish": 1} {
		if stats[cmd] != want {
			t.Errorf("calls of %s = %d, want %d (stats %v)", cmd, stats[cmd], want, stats)
		}
	}
	if _, ok := stats["evalsha"]; ok {
		t.Errorf("evalsha counted without being called: %v", stats)
	}
}

func TestMissingBinary(t *testing.T) {
	// Not parallel: t.Setenv.
	t.Setenv("PATH", t.TempDir())
	const want = `testredis: redis-server not found in PATH: install it with "apt-get install -y redis-server" (or run "make test", which installs it)`
	s, err := Start()
	if err == nil {
		s.Stop()
		t.Fatal("Start succeeded without redis-server on PATH")
	}
	if err.Error() != want {
		t.Fatalf("error = %q\nwant    %q", err, want)
	}

	// New fails the test (it must not skip it).
	tb := &recordingTB{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		New(tb)
	}()
	<-done
	if !tb.failed || tb.skipped || !strings.Contains(tb.msg, want) {
		t.Fatalf("New without redis-server: failed=%v skipped=%v msg=%q", tb.failed, tb.skipped, tb.msg)
	}
}

// recordingTB records how New ends the test instead of ending t.
type recordingTB struct {
	testing.TB
	failed, skipped bool
	msg             string
}

func (r *recordingTB) Helper() {}
func (r *recordingTB) Fatal(args ...any) {
	r.failed, r.msg = true, fmt.Sprint(args...)
	runtime.Goexit()
}
func (r *recordingTB) Fatalf(format string, args ...any) { r.Fatal(fmt.Sprintf(format, args...)) }
func (r *recordingTB) Skip(args ...any) {
	r.skipped = true
	runtime.Goexit()
}
func (r *recordingTB) Skipf(format string, args ...any) { r.Skip() }
func (r *recordingTB) SkipNow()                         { r.Skip() }

func TestPortTaken(t *testing.T) {
	t.Parallel()
	other := New(t)
	// A second server aimed at a port that another redis-server already
	// serves: the readiness check must not mistake the other server for
	// this one, and the failure must be recognised as a port clash.
	s := &Server{bin: other.bin, dir: t.TempDir(), port: other.Port()}
	s.mu.Lock()
	err := s.launch()
	s.mu.Unlock()
	if !errors.Is(err, errPortInUse) {
		t.Fatalf("launch on a taken port: err = %v, want errPortInUse", err)
	}
	if !strings.Contains(err.Error(), "redis.log") {
		t.Fatalf("error has no log tail: %v", err)
	}
	if s.cmd != nil {
		t.Fatal("failed launch left a process behind")
	}
	if got := mustDo(t, other, "PING"); got != "PONG" {
		t.Fatalf("other server: PING = %q", got)
	}

	// Restart on the same port fails, after retries, if the port stays taken.
	victim := New(t)
	if err := victim.Kill(); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", victim.Addr())
	if err != nil {
		t.Fatal(err)
	}
	err = victim.Restart()
	l.Close()
	if !errors.Is(err, errPortInUse) {
		t.Fatalf("Restart on a taken port: err = %v, want errPortInUse", err)
	}
	// Once the port is free again, Restart works.
	if err := victim.Restart(); err != nil {
		t.Fatal(err)
	}
	if got := mustDo(t, victim, "PING"); got != "PONG" {
		t.Fatalf("PING = %q", got)
	}
}

func TestStartFailureIncludesLog(t *testing.T) {
	t.Parallel()
	_, err := Start(WithArgs("--no-such-option", "1"))
	if err == nil {
		t.Fatal("Start with a bad option succeeded")
	}
	if errors.Is(err, errPortInUse) {
		t.Fatalf("bad option taken for a port clash: %v", err)
	}
	if !strings.Contains(err.Error(), "no-such-option") {
		t.Fatalf("error does not quote redis-server's complaint: %v", err)
	}
}

func TestStopAll(t *testing.T) {
	// Not parallel: StopAll stops every server of the package, and the
	// parallel tests only start after the sequential ones have finished.
	a, err := Start()
	if err != nil {
		t.Fatal(err)
	}
	b := New(t)
	StopAll()
	for _, s := range []*Server{a, b} {
		if s.PID() != 0 {
			t.Fatalf("server %s still running after StopAll", s.Addr())
		}
		if _, err := doWithin(s, time.Second, "PING"); err == nil {
			t.Fatalf("server %s answers after StopAll", s.Addr())
		}
	}
	registry.Lock()
	n := len(registry.servers)
	registry.Unlock()
	if n != 0 {
		t.Fatalf("%d servers still registered after StopAll", n)
	}
}

func TestRESPDecoder(t *testing.T) {
	t.Parallel()
	in := "+OK\r\n" +
		"-ERR boom\r\n" +
		":-42\r\n" +
		"$5\r\nhe\r\nl\r\n" +
		"$-1\r\n" +
		"$0\r\n\r\n" +
		"*3\r\n:1\r\n*2\r\n+a\r\n$1\r\nb\r\n$-1\r\n" +
		"*-1\r\n" +
		"*0\r\n"
	r := bufio.NewReader(strings.NewReader(in))
	want := []string{"OK", "ERR boom", "-42", "he\r\nl", "", "", "1\na\nb\n", "", ""}
	for i, w := range want {
		rep, err := readReply(r)
		if err != nil {
			t.Fatalf("reply %d: %v", i, err)
		}
		if got := rep.text(); got != w {
			t.Fatalf("reply %d = %q, want %q", i, got, w)
		}
	}
	if _, err := readReply(r); err == nil {
		t.Fatal("read past the end succeeded")
	}

	for _, bad := range []string{
		"",
		"\r\n",
		"?x\r\n",
		"+OK\n",
		":12x\r\n",
		"$3\r\nab\r\n",
		"$2\r\nabcd",
		"$-2\r\n",
		"$999999999999\r\n",
		"*2\r\n:1\r\n",
		"*-5\r\n",
		strings.Repeat("*1\r\n", 100) + ":1\r\n",
	} {
		if rep, err := readReply(bufio.NewReader(strings.NewReader(bad))); err == nil {
			t.Errorf("readReply(%q) = %+v, want an error", bad, rep)
		}
	}
}

func TestRESPEncoder(t *testing.T) {
	t.Parallel()
	var b strings.Builder
	w := bufio.NewWriter(&b)
	if err := writeCommand(w, []string{"SET", "k", "", "a\r\nb"}); err != nil {
		t.Fatal(err)
	}
	if want := "*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$0\r\n\r\n$4\r\na\r\nb\r\n"; b.String() != want {
		t.Fatalf("encoded %q, want %q", b.String(), want)
	}
}
