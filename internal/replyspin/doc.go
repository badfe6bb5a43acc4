// Package replyspin lets a Redis call that is alone in flight busy-poll its
// connection for the reply for a short while before it parks.
//
// A call's caller that parks on the network poller is woken by the kernel when
// the reply arrives, and on an idle CPU that wake-up costs as much as the round
// trip itself: measured on the project's 2-vCPU VM, a PING's round trip on
// loopback took 29–31 µs (p50) with a blocking read and 18–20 µs when the
// caller polled the socket instead. leash's lone lane (a script call alone in
// flight, written and read on the calling goroutine) spends most of an
// uncontended Lock or Unlock in that wait, so it polls for a while first.
//
// The polling is bounded: it happens only inside a call marked with
// Spinner.Begin and Spinner.End, only on a connection written during that call,
// only for the first read after each write, and for at most a budget of twice
// the running average of such replies' times, capped by the Spinner's maximum.
// When the average exceeds the maximum (a server farther away than a
// loopback or a rack, where polling would buy nothing), reads park at once;
// they keep measuring, so polling resumes if replies become fast again. Each
// poll yields the processor (runtime.Gosched) between attempts, so goroutines
// that have work run first.
package replyspin
