package replyspin_test

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"os"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/replyspin"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// peer is the far end of one connection: it answers each chunk it reads with
// "+OK\r\n" after delay, or, with hangUp, closes the connection instead; with
// silent it reads and never answers.
type peer struct {
	delay          time.Duration
	hangUp, silent bool
}

// dial starts a listener serving p, dials it through s and returns the client
// end; everything is closed at the test's end.
func dial(t *testing.T, s *replyspin.Spinner, p peer) net.Conn {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		sc, err := ln.Accept()
		if err != nil {
			return
		}
		defer sc.Close()
		buf := make([]byte, 512)
		for {
			if _, err := sc.Read(buf); err != nil {
				return
			}
			switch {
			case p.hangUp:
				return
			case p.silent:
				continue
			}
			time.Sleep(p.delay)
			if _, err := sc.Write([]byte("+OK\r\n")); err != nil {
				return
			}
		}
	})
	c, err := s.DialContext(context.Background(), ln.Addr().String(), &net.Dialer{Timeout: 5 * time.Second}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.Close()
		ln.Close()
		wg.Wait()
	})
	return c
}

// call writes a request and reads its reply, marked when marked is set.
func call(t *testing.T, s *replyspin.Spinner, c net.Conn, marked bool) (string, error) {
	t.Helper()
	if marked {
		s.Begin()
		defer s.End()
	}
	if _, err := c.Write([]byte("*1\r\n$4\r\nPING\r\n")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	n, err := c.Read(buf)
	return string(buf[:n]), err
}

// Every marked call's reply is read by a poll or, when it came later than the
// budget (twice the average so far), after one; the first call, before any
// average, may poll for the whole maximum and so has its reply polled.
func TestMarkedCallPollsForItsReply(t *testing.T) {
	s := replyspin.NewAnyCPU(time.Second)
	c := dial(t, s, peer{})
	for i := range 5 {
		if got, err := call(t, s, c, true); err != nil || got != "+OK\r\n" {
			t.Fatalf("call %d: %q, %v", i, got, err)
		}
		if polled, _ := s.Counts(); polled == 0 {
			t.Fatalf("call %d: the first reply was not polled", i)
		}
	}
	if polled, parked := s.Counts(); polled+parked != 5 {
		t.Fatalf("polled %d, parked %d; want 5 in all", polled, parked)
	}
	if s.Average() <= 0 || s.Average() > time.Second {
		t.Fatalf("average reply time %v, want in (0, 1s]", s.Average())
	}
	if s.Marked() {
		t.Fatal("a call is still marked after End")
	}
}

func TestUnmarkedCallParks(t *testing.T) {
	s := replyspin.NewAnyCPU(50 * time.Millisecond)
	c := dial(t, s, peer{})
	if got, err := call(t, s, c, false); err != nil || got != "+OK\r\n" {
		t.Fatalf("%q, %v", got, err)
	}
	if polled, parked := s.Counts(); polled != 0 || parked != 0 {
		t.Fatalf("polled %d, parked %d; an unmarked read must not poll", polled, parked)
	}
}

// A write made before the mark is not the marked call's: its reply does not poll.
func TestWriteBeforeTheMarkDoesNotPoll(t *testing.T) {
	s := replyspin.NewAnyCPU(50 * time.Millisecond)
	c := dial(t, s, peer{})
	if _, err := c.Write([]byte("*1\r\n$4\r\nPING\r\n")); err != nil {
		t.Fatal(err)
	}
	s.Begin()
	buf := make([]byte, 64)
	n, err := c.Read(buf)
	s.End()
	if err != nil || string(buf[:n]) != "+OK\r\n" {
		t.Fatalf("%q, %v", buf[:n], err)
	}
	if polled, parked := s.Counts(); polled != 0 || parked != 0 {
		t.Fatalf("polled %d, parked %d; want none", polled, parked)
	}
}

// A reply later than the budget parks after polling, and once the average reply
// time is above the maximum, reads park without polling.
func TestSlowRepliesStopThePolling(t *testing.T) {
	s := replyspin.NewAnyCPU(200 * time.Microsecond)
	c := dial(t, s, peer{delay: 5 * time.Millisecond})
	if got, err := call(t, s, c, true); err != nil || got != "+OK\r\n" {
		t.Fatalf("%q, %v", got, err)
	}
	if polled, parked := s.Counts(); polled != 0 || parked != 1 {
		t.Fatalf("first slow reply: polled %d, parked %d; want 0 and 1", polled, parked)
	}
	if s.Average() <= 200*time.Microsecond {
		t.Fatalf("average %v, want above the 200µs maximum", s.Average())
	}
	for range 3 {
		if _, err := call(t, s, c, true); err != nil {
			t.Fatal(err)
		}
	}
	if polled, parked := s.Counts(); polled != 0 || parked != 1 {
		t.Fatalf("after the average passed the maximum: polled %d, parked %d; want 0 and 1", polled, parked)
	}
}

func TestPollKeepsTheReadDeadline(t *testing.T) {
	s := replyspin.NewAnyCPU(time.Hour) // the budget never ends the poll here
	c := dial(t, s, peer{silent: true})
	if err := c.SetReadDeadline(time.Now().Add(20 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_, err := call(t, s, c, true)
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("err %v, want the deadline's", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("the read returned after %v", d)
	}
}

func TestPollSeesTheEndOfTheStream(t *testing.T) {
	s := replyspin.NewAnyCPU(time.Hour)
	c := dial(t, s, peer{hangUp: true})
	if _, err := call(t, s, c, true); !errors.Is(err, io.EOF) {
		t.Fatalf("err %v, want io.EOF", err)
	}
	if polled, parked := s.Counts(); polled != 0 || parked != 0 || s.Average() != 0 {
		t.Fatalf("the end of the stream counted as a reply: polled %d, parked %d, average %v", polled, parked, s.Average())
	}
}

func TestCloseEndsAPoll(t *testing.T) {
	s := replyspin.NewAnyCPU(time.Hour)
	c := dial(t, s, peer{silent: true})
	s.Begin()
	defer s.End()
	if _, err := c.Write([]byte("*1\r\n$4\r\nPING\r\n")); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := c.Read(make([]byte, 64))
		done <- err
	}()
	deadline := time.Now().Add(10 * time.Second)
	for s.Polling() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the read never started polling")
		}
		runtime.Gosched()
	}
	c.Close() // ends the poll under way
	select {
	case err := <-done:
		if !errors.Is(err, net.ErrClosed) {
			t.Fatalf("err %v, want net.ErrClosed", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not end the read")
	}
}

func TestNestedMarksEndWithTheOutermost(t *testing.T) {
	s := replyspin.NewAnyCPU(time.Millisecond)
	s.Begin()
	s.Begin()
	s.End()
	if !s.Marked() {
		t.Fatal("the inner End ended the outer mark")
	}
	s.End()
	if s.Marked() {
		t.Fatal("the outer End left the mark")
	}
}

func TestOffAndTLS(t *testing.T) {
	for _, max := range []time.Duration{0, -time.Second} {
		if s := replyspin.New(max); s != nil {
			t.Fatalf("New(%v) = %v, want nil", max, s)
		}
	}
	var s *replyspin.Spinner // nil: Begin, End and Counts do nothing
	s.Begin()
	s.End()
	if p, k := s.Counts(); p != 0 || k != 0 {
		t.Fatal("a nil Spinner counted")
	}
	_, err := replyspin.NewAnyCPU(time.Millisecond).DialContext(context.Background(), "127.0.0.1:1", &net.Dialer{}, &tls.Config{})
	if !errors.Is(err, replyspin.ErrTLS) {
		t.Fatalf("err %v, want ErrTLS", err)
	}
}

// One reply from a stalled server counts as at most 8 times the maximum, so a
// few fast replies bring the polling back.
func TestStallCountsAsAtMostEightTimesTheMaximum(t *testing.T) {
	s := replyspin.NewAnyCPU(time.Millisecond)
	c := dial(t, s, peer{delay: 50 * time.Millisecond})
	if _, err := call(t, s, c, true); err != nil {
		t.Fatal(err)
	}
	if avg := s.Average(); avg != 8*time.Millisecond {
		t.Fatalf("average after one 50ms reply: %v, want 8ms (clamped)", avg)
	}
}
